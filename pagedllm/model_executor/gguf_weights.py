"""Reading a GGUF file (llama.cpp's format, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
as a checkpoint, with the ``gguf`` package's reader (tensors are memory-mapped, not copied).

Tensor names are mapped back to Hugging Face's (``blk.0.attn_q.weight`` ->
``model.layers.0.self_attn.q_proj.weight``) with ``gguf``'s own name tables, and the rows of
Llama's q / k weights are un-permuted (llama.cpp's converter interleaves each head's two
rotary halves; see ``unpermute_rows``). Per tensor type:

- F32 / F16 / BF16: the tensor itself;
- Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K (``KERNEL_TYPES``) in
  linear layers: ``packed_int``'s canonical layout (``qweight`` / ``scales`` / ``qzeros``),
  run by the ``linear_w4`` / ``linear_w8g`` kernels with the blocks' own arithmetic:
  Q4_0 W = d * (q - 8); Q4_1 W = d * q + m, i.e. zero point -m / d; Q5_0 / Q5_1 likewise
  with 5-bit q (8-bit storage, zero point 16 / -m / d); Q8_0 W = d * q (q signed, stored as
  q + 128 with zero point 128); the K-quants as ``gguf_kquants`` says. (llama.cpp's Q4_K_M
  files fall back to Q5_0 / Q8_0 for rows that are not whole 256-input super-blocks, e.g.
  Qwen2-0.5B's 896 inputs.) A fused layer
  whose parts have different layouts (Q4_K_M files keep attn_v in Q6_K) takes the widest
  bits and the smallest group of its parts (the others' scales repeated: still exact);
- any other type (Q2_K, Q3_K, IQ ..., TQ ...), and embeddings / norms / the lm_head: dequantized
  at load by ``gguf`` to float32 (a warning names the types that have no kernel yet).

Mixture-of-experts files (Mixtral, written as "llama" with experts; Qwen2-MoE, its shared
expert ``ffn_*_shexp`` a dense MLP; Qwen3-MoE): the router ``ffn_gate_inp`` is a float tensor; each stacked expert tensor ``ffn_{gate,up,down}_exps``
[E, rows, inputs] is yielded per expert under the checkpoint's names
(``model.layers.N.mlp.experts.<e>.<projection>.<qweight|scales|qzeros>`` for a kernel type
whose ``FusedMoE`` took the GGUF method, else ``.weight`` dequantized).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from transformers import PretrainedConfig

from pagedllm.model_executor.gguf_kquants import affine_to_canonical, decode_k_blocks, float16_values

logger = logging.getLogger(__name__)

#: GGUF ``general.architecture`` -> the ``gguf`` package's architecture name; only these load.
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}

#: The ggml types the kernels run, by name -> (bits of the kernel's storage, inputs per group).
KERNEL_TYPES = {
    "Q4_0": (4, 32), "Q4_1": (4, 32), "Q5_0": (8, 32), "Q5_1": (8, 32), "Q8_0": (8, 32),
    "Q4_K": (4, 32), "Q5_K": (8, 32), "Q6_K": (8, 16),
}  # fmt: skip

_UNQUANTIZED_TYPES = ("F32", "F16", "BF16")
_BLOCK = 32  # inputs per Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 block

#: Hugging Face module names of one decoder layer (``{i}`` is the layer index).
_LAYER_MODULES = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "input_layernorm", "post_attention_layernorm", "mlp.gate", "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj", "mlp.shared_expert_gate",
)  # fmt: skip

#: ``FusedMoE`` shard id of each stacked expert tensor -> transformers' stacked module name
#: (``gguf``'s name tables map it to ``ffn_gate_exps`` / ``ffn_down_exps`` / ``ffn_up_exps``).
_STACKED_EXPERTS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
#: A stacked expert tensor's Hugging Face name here: ``<layer>.mlp.experts.<shard id>.weight``.
_STACKED_EXPERT_NAME = re.compile(r"(?P<layer>.+\.experts)\.(?P<shard>w[123])\.weight")
#: The checkpoint's name of each expert matrix (shard id -> projection), by model type; others:
#: ``_STACKED_EXPERTS``' (Qwen-MoE's gate_proj / down_proj / up_proj).
_EXPERT_PROJECTIONS = {"mixtral": {"w1": "w1", "w2": "w2", "w3": "w3"}}


def open_gguf(path: Path):
    """The ``gguf.GGUFReader`` of ``path``.

    Raises:
        ValueError: the file is not a GGUF file (the reader's message).
    """
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc


def gguf_to_hf_names(model_type: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, for a model of ``model_type`` (config.json's)
    with ``num_layers`` decoder layers. A stacked expert tensor (``blk.N.ffn_gate_exps.weight``
    [E, I, H] ...) is named ``model.layers.N.mlp.experts.<w1|w2|w3>.weight`` (``FusedMoE``'s
    shard ids: gate, down, up); ``iterate_gguf_weights`` yields it per expert.

    Raises:
        ValueError: an architecture this loader does not read (the message lists those it does).
    """
    import gguf

    arch_name = GGUF_ARCHITECTURES.get(model_type)
    if arch_name is None:
        raise ValueError(f"GGUF model type {model_type!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}.")
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch_name)
    name_map = gguf.get_tensor_name_map(arch, num_layers)
    modules = ["model.embed_tokens", "model.norm", "lm_head"]
    modules += [f"model.layers.{i}.{module}" for i in range(num_layers) for module in _LAYER_MODULES]
    names = {}
    for module in modules:
        gguf_module = name_map.get_name(module)
        if gguf_module is not None:
            names.update({f"{gguf_module}{suffix}": f"{module}{suffix}" for suffix in (".weight", ".bias")})
    for i in range(num_layers):
        for shard_id, stacked in _STACKED_EXPERTS.items():
            gguf_module = name_map.get_name(f"model.layers.{i}.mlp.experts.{stacked}")
            if gguf_module is not None:
                names[f"{gguf_module}.weight"] = f"model.layers.{i}.mlp.experts.{shard_id}.weight"
    return names


def tensor_types(reader, hf_config: PretrainedConfig) -> dict[str, str]:
    """Hugging Face tensor name -> its ggml type name ("Q4_0", "F16" ...), for every tensor of
    the file (read from the header only)."""
    names = gguf_to_hf_names(hf_config.model_type, hf_config.num_hidden_layers)
    return {names.get(t.name, t.name): t.tensor_type.name for t in reader.tensors}


def unpermute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q / k row permutation: within each of ``num_heads`` heads, its rows are
    stored as pairs (i, i + half) interleaved; this returns them in Hugging Face's order
    (``convert_hf_to_gguf.py``'s ``LlamaModel.permute``, inverted). ``rows`` [out, ...]."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def decode_blocks(raw: np.ndarray, type_name: str, num_inputs: int, group: int = _BLOCK) -> dict[str, torch.Tensor]:
    """Rows of a ``KERNEL_TYPES`` type (``raw`` [out, blocks * bytes per block] uint8) ->
    ``qweight`` [out, in] uint8, ``scales`` and ``qzeros`` [out, in / group] float32 with
    W = scales * (qweight - qzeros) per group (see the module docstring; Q4_1 blocks with
    d = 0, all weights m, become q = 1, zero 0, scale m). ``group`` divides the type's own
    group (a fused layer's smaller one): its scales and zero points are repeated."""
    tensors = _decode(raw, type_name, num_inputs)
    repeat = num_inputs // tensors["scales"].shape[1] // group
    return {key: torch.from_numpy(np.ascontiguousarray(value if key == "qweight" else value.repeat(repeat, axis=1)))
            for key, value in tensors.items()}  # fmt: skip


def _decode(raw: np.ndarray, type_name: str, num_inputs: int) -> dict[str, np.ndarray]:
    """``decode_blocks`` in the type's own groups, as numpy arrays. A 32-input block is d
    (float16), then m (float16, the "_1" types), then the fifth bits (uint32, Q5), then the
    quants: Q8_0's 32 int8, or 16 bytes holding element j in the low and j + 16 in the high
    nibble of byte j."""
    if type_name.endswith("_K"):
        return decode_k_blocks(raw, type_name, num_inputs)
    out = raw.shape[0]
    blocks = raw.reshape(out, num_inputs // _BLOCK, -1)
    d = float16_values(blocks[..., 0:2])
    if type_name == "Q8_0":
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return {"qweight": q.reshape(out, num_inputs), "scales": d, "qzeros": np.full_like(d, 128.0)}
    has_min = type_name.endswith("_1")
    start = 4 if has_min else 2
    high = np.zeros((), dtype=np.uint8)
    if type_name.startswith("Q5"):
        bits = np.ascontiguousarray(blocks[..., start : start + 4]).view(np.uint32)  # [out, blocks, 1]
        high = ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        start += 4
    qs = blocks[..., start:]
    q = (np.concatenate([qs & 15, qs >> 4], axis=-1) | (high << 4)).reshape(out, num_inputs)
    if has_min:
        return affine_to_canonical(q, d, -float16_values(blocks[..., 2:4]), _BLOCK)
    return {"qweight": q, "scales": d, "qzeros": np.full_like(d, 16.0 if type_name == "Q5_0" else 8.0)}


def _expert_tensors(tensor, match: re.Match, model_type: str,
                    layout: tuple[int, int] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """One stacked expert tensor of the file (``match``: its ``_STACKED_EXPERT_NAME``) as
    per-expert tensors in the checkpoint's names (``<layer>.<e>.<projection>.<tensor>``): the
    canonical ``qweight`` / ``scales`` / ``qzeros`` of a ``KERNEL_TYPES`` type in ``layout``'s
    groups, else the dequantized ``weight`` [rows, inputs] float32.

    Raises:
        ValueError: the tensor is not 3-D (experts, rows, inputs).
    """
    import gguf

    shape = tuple(reversed([int(d) for d in tensor.shape]))  # GGUF lists dimensions innermost first
    if len(shape) != 3:
        raise ValueError(f"GGUF expert tensor {tensor.name!r} has shape {list(shape)}; "
                         "expected [experts, rows, inputs].")
    num_experts, rows, num_inputs = shape
    proj = _EXPERT_PROJECTIONS.get(model_type, _STACKED_EXPERTS)[match["shard"]]
    raw = np.asarray(tensor.data)
    if layout is not None and tensor.tensor_type.name in KERNEL_TYPES:
        decoded = decode_blocks(raw.reshape(num_experts * rows, -1), tensor.tensor_type.name, num_inputs, layout[1])
        per_expert = {key: value.view(num_experts, rows, -1) for key, value in decoded.items()}
    else:
        values = np.array(gguf.dequantize(raw, tensor.tensor_type), copy=True)
        per_expert = {"weight": torch.from_numpy(values).reshape(shape)}
    for expert in range(num_experts):
        for key, value in per_expert.items():
            yield f"{match['layer']}.{expert}.{proj}.{key}", value[expert]


def iterate_gguf_weights(
    path: Path, hf_config: PretrainedConfig, kernel_modules: dict[str, tuple[int, int]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(Hugging Face name, tensor)`` for every tensor of the GGUF file: the canonical
    integer layout for the weights of ``kernel_modules`` (module name, e.g.
    ``model.layers.0.self_attn.q_proj`` -> its layer's (bits, group)), float tensors for the
    rest (see the module docstring). Logs which kernel each type's tensors run on.

    Raises:
        ValueError: an unreadable file or an unsupported architecture.
    """
    import gguf

    reader = open_gguf(path)
    names = gguf_to_hf_names(hf_config.model_type, hf_config.num_hidden_layers)
    permuted = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}
    dequantized: set[str] = set()
    kernels: dict[str, set[tuple[int, int]]] = {}
    for tensor in reader.tensors:
        name = names.get(tensor.name, tensor.name)
        module, _, _ = name.rpartition(".")
        type_name = tensor.tensor_type.name
        experts = _STACKED_EXPERT_NAME.fullmatch(name)
        if experts is not None:
            if module in kernel_modules and type_name in KERNEL_TYPES:
                kernels.setdefault(type_name, set()).add(kernel_modules[module])
            elif type_name not in _UNQUANTIZED_TYPES:
                dequantized.add(f"{name} ({type_name})")
            yield from _expert_tensors(tensor, experts, hf_config.model_type, kernel_modules.get(module))
            continue
        heads = permuted.get(module.rpartition(".")[2]) if GGUF_ARCHITECTURES[hf_config.model_type] == "llama" else None
        num_inputs = int(tensor.shape[0])  # GGUF lists dimensions innermost first
        if module in kernel_modules and type_name in KERNEL_TYPES and name.endswith(".weight"):
            kernels.setdefault(type_name, set()).add(kernel_modules[module])
            for key, value in decode_blocks(np.asarray(tensor.data), type_name, num_inputs, kernel_modules[module][1]).items():
                yield f"{module}.{key}", value if heads is None else unpermute_rows(value, heads)
            continue
        if type_name not in _UNQUANTIZED_TYPES:
            dequantized.add(f"{name} ({type_name})")
        values = torch.from_numpy(np.array(gguf.dequantize(np.asarray(tensor.data), tensor.tensor_type), copy=True))
        values = values.reshape(tuple(reversed([int(d) for d in tensor.shape])))
        if name.endswith("mlp.shared_expert_gate.weight") and values.dim() == 1:
            values = values[None]  # llama.cpp's ffn_gate_inp_shexp [H]: the gate's one row
        yield name, values if heads is None or not name.endswith((".weight", ".bias")) else unpermute_rows(values, heads)
    for type_name, layouts in sorted(kernels.items()):
        logger.info(
            "%s: %s linear weights run on %s.", path.name, type_name,
            " and ".join(f"{'linear_w4' if bits == 4 else 'linear_w8g'} (int{bits}, groups of {group})"
                         for bits, group in sorted(layouts)),
        )  # fmt: skip
    if dequantized:
        shown = sorted(dequantized)
        logger.warning(
            "%s: %d quantized tensors dequantized at load to the model dtype (embeddings and the lm_head, or types "
            "without a kernel here): %s%s.", path.name, len(shown), ", ".join(shown[:6]), " ..." if len(shown) > 6 else "",
        )  # fmt: skip
