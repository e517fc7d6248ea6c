"""Writing a Hugging Face checkpoint (Llama / Mistral / Qwen2 / Qwen3 layout, safetensors) as
a GGUF file, with the ``gguf`` package's writer and quantizers, the way llama.cpp's
``convert_hf_to_gguf.py`` lays it out: GGUF tensor names, architecture metadata, Llama's q / k
rows permuted (each head's two rotary halves interleaved), linear weights in ``linear_type``
(or per module in ``module_types``, e.g. llama.cpp's Q4_K_M keeps v_proj and down_proj in
Q6_K) and everything else (embeddings, norms, the lm_head) in ``other_type``. K-quants are
written by ``gguf_kquant_writer`` (``gguf`` cannot write them). No tokenizer is written: load
the file with ``tokenizer=`` the checkpoint directory.

    from pagedllm.testing.gguf_writer import write_gguf
    write_gguf(checkpoint_dir, out_dir / "model-Q4_0.gguf", linear_type="Q4_0")
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors.torch import load_file

from pagedllm.config import load_hf_config
from pagedllm.model_executor.gguf_weights import GGUF_ARCHITECTURES, gguf_to_hf_names
from pagedllm.testing.gguf_kquant_writer import quantize_k

_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def permute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's q / k row order: within each head, rows i and i + half become neighbours
    (the inverse of ``gguf_weights.unpermute_rows``)."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, 2, half, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def write_gguf(
    checkpoint: Path, out: Path, linear_type: str = "Q4_0", other_type: str = "F32",
    module_types: Optional[dict[str, str]] = None,
) -> Path:
    """Write ``checkpoint`` as the GGUF file ``out`` (see the module docstring); ``linear_type``,
    ``other_type`` and the values of ``module_types`` (linear module short name, e.g.
    "v_proj" -> type) are ggml type names that ``gguf.quants.quantize`` writes (F32, F16,
    BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) or Q4_K / Q5_K / Q6_K. Returns ``out``.

    Raises:
        ValueError: an architecture GGUF_ARCHITECTURES lacks, or a type gguf cannot write.
    """
    import gguf

    config = load_hf_config(checkpoint)
    arch = GGUF_ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ValueError(f"Cannot write model type {config.model_type!r} as GGUF.")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(checkpoint.name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    writer.add_vocab_size(config.vocab_size)
    to_gguf = {hf: name for name, hf in gguf_to_hf_names(config.model_type, config.num_hidden_layers).items()}
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for path in sorted(checkpoint.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            module = name.rsplit(".", 2)[-2]
            values = tensor.float()
            if arch == "llama" and module in heads:
                values = permute_rows(values, heads[module])
            is_linear = module in _LINEAR_MODULES and name.endswith(".weight")
            type_name = (module_types or {}).get(module, linear_type) if is_linear else other_type
            qtype = gguf.GGMLQuantizationType[type_name]
            array = values.numpy().astype(np.float32)
            data = quantize_k(array, type_name) if type_name.endswith("_K") else gguf.quants.quantize(array, qtype)
            writer.add_tensor(to_gguf[name], data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
