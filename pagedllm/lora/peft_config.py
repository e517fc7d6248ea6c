"""Read and check a PEFT LoRA adapter folder against the base model, without loading its
tensors (the front end checks every new adapter here, so a bad one is refused with a clear
error before it reaches the engine).

PEFT's format (``peft.LoraConfig`` / ``save_pretrained``): ``adapter_config.json`` with ``r``,
``lora_alpha``, ``use_rslora``, ``target_modules`` ..., and tensors named
``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r] in
``adapter_model.safetensors`` (or ``.bin``). The update of a module is
``W' = W + scaling * B A`` with ``scaling = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
rsLoRA (Kalajdzievski 2023; PEFT's ``use_rslora``).

Supported: ``target_modules`` among the Llama family's q/k/v/o_proj and gate/up/down_proj
(a list of names, or PEFT's regex string: then the tensors it matched are checked),
``bias: "none"``; in an image-text model, those of its language model (PEFT's names
``model.language_model.layers.*`` of transformers 5, ``language_model.model.layers.*`` of
transformers 4), not the vision tower's or the projector's. Refused with a ``ValueError`` naming the option: DoRA (``use_dora``),
``modules_to_save``, extra vocabulary (embedding / lm_head adapters), mixture-of-experts
experts (tensors under ``.experts.``), per-module
``rank_pattern`` / ``alpha_pattern``, a rank above ``max_lora_rank``, modules the model lacks
and tensors whose shapes do not fit the base.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.lora.request import adapter_weight_file

#: Target module -> its parent module in a decoder layer (Llama / Qwen2 / Qwen3 / Mistral).
TARGET_PARENTS = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}

#: Why an adapter on mixture-of-experts experts (Mixtral's w1 / w2 / w3 ...) is refused.
EXPERTS_REFUSED = "LoRA on mixture-of-experts experts (FusedMoE) is not supported"

#: The decoder layers' prefixes: a language model's, then an image-text model's language model's.
_LAYERS = r"(?:model\.|model\.language_model\.|language_model\.model\.)layers"
_WEIGHT_NAME = re.compile(rf"base_model\.model\.{_LAYERS}\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight")


@dataclass(frozen=True)
class PeftAdapterConfig:
    """What ``adapter_config.json`` says that matters here."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        """``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA (PEFT's ``LoraLayer``)."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def read_adapter_config(lora_path: str) -> PeftAdapterConfig:
    """Parse and check ``<lora_path>/adapter_config.json``.

    Raises:
        FileNotFoundError: no adapter at ``lora_path``.
        ValueError: not a LoRA adapter, or an option not supported (named in the message).
    """
    adapter_weight_file(lora_path)
    raw: dict[str, Any] = json.loads((Path(lora_path).expanduser() / "adapter_config.json").read_text())
    where = f"LoRA adapter {lora_path!r}"
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {raw['peft_type']!r} is not supported (only LORA).")
    refused = {
        "use_dora": "DoRA (use_dora) is not supported",
        "modules_to_save": "modules_to_save is not supported (the adapter would replace whole modules)",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "trainable_token_indices": "extra vocabulary (trainable_token_indices) is not supported",
    }
    for option, why in refused.items():
        if raw.get(option):
            raise ValueError(f"{where}: {why}.")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias {raw['bias']!r} is not supported (only 'none').")
    targets = raw.get("target_modules") or []
    # A string is PEFT's regex over full module names (the way to pick an image-text model's
    # language model): what it matched is checked tensor by tensor (``check_adapter``).
    targets = [targets] if isinstance(targets, str) else list(targets)
    regex = isinstance(raw.get("target_modules"), str)
    unknown = [] if regex else sorted(t for t in targets if t not in TARGET_PARENTS)
    if unknown:
        raise ValueError(
            f"{where}: target module(s) {unknown} are not in this model; LoRA applies to {sorted(TARGET_PARENTS)} "
            f"({EXPERTS_REFUSED})."
        )
    r = raw.get("r")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {r!r}.")
    return PeftAdapterConfig(
        r=r, lora_alpha=float(raw.get("lora_alpha", 8)), use_rslora=bool(raw.get("use_rslora", False)),
        target_modules=tuple(targets),
    )


def read_tensor_shapes(weight_file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of an adapter weight file: a safetensors file's header only, or a
    ``.bin`` (a torch pickle, memory-mapped)."""
    if weight_file.suffix == ".safetensors":
        with open(weight_file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        return {name: tuple(meta["shape"]) for name, meta in header.items() if name != "__metadata__"}
    import torch

    state = torch.load(weight_file, map_location="cpu", weights_only=True, mmap=True)
    return {name: tuple(t.shape) for name, t in state.items()}


def module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """Target module -> (in features, out features) in a decoder layer of ``hf_config``'s model."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {
        "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }


def parse_weight_name(name: str, lora_path: str) -> tuple[int, str, str]:
    """``base_model.model.model.layers.<i>.<parent>.<target>.lora_<A|B>.weight`` (or an
    image-text model's ``model.language_model.layers`` / ``language_model.model.layers``) ->
    (layer index i, target, "A" or "B").

    Raises:
        ValueError: any other tensor (embedding or lm_head adapters: extra vocabulary;
            DoRA magnitudes; biases; modules outside the supported targets, such as a
            vision tower's).
    """
    if ".experts." in name:
        raise ValueError(f"LoRA adapter {lora_path!r}: tensor {name!r} adapts an expert: {EXPERTS_REFUSED}.")
    match = _WEIGHT_NAME.fullmatch(name)
    if match is None or TARGET_PARENTS.get(match.group(3)) != match.group(2):
        raise ValueError(
            f"LoRA adapter {lora_path!r}: tensor {name!r} is not supported (LoRA A/B of "
            f"{sorted(TARGET_PARENTS)} of the language model's decoder layers only: no embedding / lm_head / vision "
            "tower adapters, DoRA or biases)."
        )
    return int(match.group(1)), match.group(3), match.group(4)


def check_adapter(lora_path: str, hf_config: Any, max_lora_rank: int) -> PeftAdapterConfig:
    """Check an adapter folder against the base model (config, tensor names and shapes).

    Raises:
        FileNotFoundError: no adapter at ``lora_path``.
        ValueError: an unsupported option or tensor, a rank above ``max_lora_rank``, a layer
            the model lacks, or a shape that does not fit the base (named in the message).
    """
    config = read_adapter_config(lora_path)
    where = f"LoRA adapter {lora_path!r}"
    if config.r > max_lora_rank:
        raise ValueError(f"{where}: rank {config.r} is greater than max_lora_rank {max_lora_rank} (--max-lora-rank).")
    shapes = module_shapes(hf_config)
    num_layers = hf_config.num_hidden_layers
    for name, shape in read_tensor_shapes(adapter_weight_file(lora_path)).items():
        layer, target, ab = parse_weight_name(name, lora_path)
        if layer >= num_layers:
            raise ValueError(f"{where}: tensor {name!r} is for layer {layer}, but the model has {num_layers} layers.")
        in_features, out_features = shapes[target]
        expected = (config.r, in_features) if ab == "A" else (out_features, config.r)
        if shape != expected:
            raise ValueError(
                f"{where}: tensor {name!r} has shape {list(shape)}, but this base model needs {list(expected)} "
                f"({target}: {in_features} -> {out_features} features, r={config.r})."
            )
    return config
