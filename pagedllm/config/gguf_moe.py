"""The mixture-of-experts settings of a GGUF file that transformers' GGUF config reader leaves
out, read from the file's metadata (llama.cpp's ``convert_hf_to_gguf.py`` writes them):

- Mixtral is written as architecture "llama" with ``llama.expert_count`` /
  ``llama.expert_used_count``; transformers reads a dense Llama config. With experts it
  becomes a ``MixtralConfig`` (``num_local_experts``, ``num_experts_per_tok``; each expert's
  size is ``feed_forward_length``, transformers' ``intermediate_size``).
- Qwen2-MoE's and Qwen3-MoE's expert size is ``<arch>.expert_feed_forward_length`` (and
  Qwen2-MoE's shared expert's ``expert_shared_feed_forward_length``); transformers keeps
  ``moe_intermediate_size`` (``shared_expert_intermediate_size``) at its default. They are set.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig


#: Qwen-MoE metadata keys (after the architecture) -> the config attribute they set.
_QWEN_MOE_FIELDS = {
    "qwen2_moe": {"expert_feed_forward_length": "moe_intermediate_size",
                  "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3_moe": {"expert_feed_forward_length": "moe_intermediate_size"},
}


def _fields(path: Path) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}


def complete_moe_config(hf_config: PretrainedConfig, path: Path) -> PretrainedConfig:
    """``hf_config`` (transformers' config of GGUF file ``path``) with the file's expert
    settings (see the module docstring); the config unchanged for a dense file."""
    if hf_config.model_type not in ("llama", "mistral", "qwen2_moe", "qwen3_moe"):
        return hf_config
    fields = _fields(path)
    arch = fields.get("general.architecture")
    if hf_config.model_type in _QWEN_MOE_FIELDS:
        for key, attribute in _QWEN_MOE_FIELDS[hf_config.model_type].items():
            if fields.get(f"{arch}.{key}") is not None:
                setattr(hf_config, attribute, int(fields[f"{arch}.{key}"]))
        return hf_config
    num_experts = int(fields.get(f"{arch}.expert_count") or 0)
    if not num_experts:
        return hf_config
    from transformers import MixtralConfig

    dropped = ("model_type", "architectures", "transformers_version")
    settings = {k: v for k, v in hf_config.to_dict().items() if k not in dropped}
    settings.update(num_local_experts=num_experts, num_experts_per_tok=int(fields[f"{arch}.expert_used_count"]))
    return MixtralConfig(**settings, architectures=["MixtralForCausalLM"])
