"""Rotary position embeddings (RoFormer, Su et al. 2021, arXiv:2104.09864) and their
scalings, with the math of transformers' ``modeling_rope_utils.ROPE_INIT_FUNCTIONS``
(``d`` is the rotary dimension, ``base`` ``rope_theta``):

  default   inv_freq_i = base^(-2i/d)
  linear    inv_freq / factor (positions divided by ``factor``)
  dynamic   NTK-aware: base grown from the sequence length past ``max_position_embeddings``
  yarn      inv_freq ramped between interpolated (/ factor) and extrapolated channels by
            ``beta_fast`` / ``beta_slow`` rotations over ``original_max_position_embeddings``
            (``truncate``: whole channels); cos / sin x ``attention_factor`` (mscale)
  longrope  inv_freq / ``short_factor`` (or ``long_factor`` past the original length), per
            channel; cos / sin x ``attention_factor``
  llama3    inv_freq rescaled by wavelength (Llama 3.1)

The length-dependent types are applied per position, so that a token's rotation depends on
its position alone, never on the batch: "dynamic" rotates the token at position p with the
base transformers computes for a sequence of max(p + 1, max_position_embeddings) tokens,
"longrope" with the long factors when p >= original_max_position_embeddings. transformers
recomputes both per forward from the largest position in it; for a sequence generated
token by token (its decode steps) that is the same, so greedy outputs match transformers'
whenever the prompt fits in that original length (a longer prompt, rotated there as one
forward with its full length, is rotated here token by token).

Layouts (vLLM's ``is_neox_style``): neox rotates the two halves of the rotary channels
together (Llama, Qwen, Phi, Gemma); the other one rotates interleaved pairs (2i, 2i + 1)
(GPT-J, GLM-4). With ``rotary_dim`` < ``head_dim`` only the first ``rotary_dim`` channels
rotate (``partial_rotary_factor``); the others pass through.

``RotaryEmbedding`` is a ``CustomOp``: on CPU the C++ kernel rotates neox queries and keys
in place; elsewhere (and without the kernels, and for the interleaved layout) PyTorch
returns new tensors. ``get_rope`` builds one per set of parameters and shares it.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Optional

import torch

from pagedllm.arch_config import get_rope_parameters, rope_context_len
from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.custom_op import CustomOp

__all__ = ["RotaryEmbedding", "get_rope", "get_rope_parameters"]

# NOTE: models are built under ``torch.set_default_dtype(model dtype)``: every tensor here
# is made float32 explicitly (as transformers computes them), never by the default dtype.
_F32 = torch.float32


def _exponents(dim: int) -> torch.Tensor:
    """2i / d for i < d / 2, float32 [d / 2]."""
    return torch.arange(0, dim, 2, dtype=torch.int64).to(_F32) / dim


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** _exponents(dim))


def _linear(params: dict, base: float, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    return _default_inv_freq(base, dim) / params["factor"], 1.0


def _dynamic_base(params: dict, base: float, dim: int, max_position: int) -> float:
    factor = params["factor"]
    return base * ((factor * max_position / max_position) - (factor - 1)) ** (dim / (dim - 2))


def _dynamic(params: dict, base: float, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """The base of a sequence within ``max_position`` (transformers' value at init)."""
    return _default_inv_freq(_dynamic_base(params, base, dim, max_position), dim), 1.0


def _dynamic_long_inv_freq(params: dict, base: float, dim: int, max_position: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """[N, d / 2] inverse frequencies for sequences of ``seq_lens`` [N] (int64) tokens, each
    > ``max_position``: transformers' float32 tensor arithmetic of its forward-time update."""
    factor = params["factor"]
    ratio = (factor * seq_lens.to(_F32) / max_position) - (factor - 1)
    # NOTE: transformers raises a 0-dim float32 tensor to a Python float, which PyTorch
    # computes in float64; a [N] tensor would be raised in float32 (1 ulp apart).
    grown = base * (ratio.double() ** (dim / (dim - 2))).to(_F32)
    return 1.0 / (grown[:, None] ** _exponents(dim)[None, :])


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict, base: float, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    factor = factor if factor is not None else max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def channel(rotations: float) -> float:  # the channel that turns ``rotations`` times over ``original``
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = channel(beta_fast), channel(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=_F32) - low) / (high - low), 0, 1)
    extrapolated_share = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(_F32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated_share) + (1.0 / pos_freqs) * extrapolated_share
    return inv_freq, attention_factor


def _longrope_inv_freq(factors: list, base: float, dim: int) -> torch.Tensor:
    if len(factors) != dim // 2:
        raise ValueError(f"longrope factors have {len(factors)} entries; the rotary dimension {dim} needs {dim // 2}.")
    return 1.0 / (torch.tensor(factors, dtype=_F32) * base ** _exponents(dim))


def _longrope(params: dict, base: float, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """The short factors' frequencies; the long ones are ``_freqs``' rows past the original length."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    _longrope_inv_freq(params["long_factor"], base, dim)  # checks its length now
    return _longrope_inv_freq(params["short_factor"], base, dim), attention_factor


def _llama3(params: dict, base: float, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    inv_freq = _default_inv_freq(base, dim)
    factor = params["factor"]
    low_freq_factor = params.get("low_freq_factor", 1.0)
    high_freq_factor = params.get("high_freq_factor", 4.0)
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


#: rope type -> (params, base, rotary dim, max_position) -> (inv_freq [d / 2] float32, attention
#: factor); the types of ``pagedllm.arch_config.ROPE_TYPES``.
_INV_FREQ: dict[str, Callable[[dict, float, int, int], tuple[torch.Tensor, float]]] = {
    "default": lambda params, base, dim, max_position: (_default_inv_freq(base, dim), 1.0),
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "longrope": _longrope,
    "llama3": _llama3,
}


def _freqs(rope_type: str, params: dict, base: float, dim: int, max_position: int, num_positions: int) -> tuple[torch.Tensor, float]:
    """Angles [num_positions, d / 2] (float32) of positions 0 .. num_positions - 1, and the
    factor cos / sin are scaled by; the length-dependent types per position (module docstring)."""
    inv_freq, attention_factor = _INV_FREQ[rope_type](params, base, dim, max_position)
    positions = torch.arange(num_positions, dtype=_F32)
    freqs = torch.outer(positions, inv_freq)
    if rope_type == "dynamic" and num_positions > max_position:
        seq_lens = torch.arange(max_position + 1, num_positions + 1, dtype=torch.int64)
        long_inv_freq = _dynamic_long_inv_freq(params, base, dim, max_position, seq_lens)
        freqs[max_position:] = positions[max_position:, None] * long_inv_freq
    original = params.get("original_max_position_embeddings") or max_position
    if rope_type == "longrope" and num_positions > original:
        freqs[original:] = torch.outer(positions[original:], _longrope_inv_freq(params["long_factor"], base, dim))
    return freqs, attention_factor


class RotaryEmbedding(CustomOp):
    """Applies RoPE to queries and keys given each token's position: ``cos_sin(positions)``
    once per forward pass, then ``self(query, key, cos, sin)`` in every layer.

    Args:
        head_dim: channels per head.
        max_position: the model's ``max_position_embeddings`` (tokens): "dynamic"'s original
            length, "yarn" / "longrope"'s factor when theirs is null.
        base: ``rope_theta``.
        rope_scaling: the rope type and its keys (an HF ``rope_scaling`` / ``rope_parameters``
            dict, ``type`` or ``rope_type``; its ``rope_theta`` and ``partial_rotary_factor``
            are not read: ``base`` and ``rotary_dim`` are) or None: "default".
        rotary_dim: channels that rotate, the first ones (default ``head_dim``).
        is_neox_style: halves (True) or interleaved pairs (False); see the module docstring.
        num_positions: positions the cos / sin table covers (default: ``rope_context_len``,
            the context length the engine derives for this rope).

    Raises:
        ValueError: an unsupported rope type, an odd or too large ``rotary_dim``, longrope
            factors not of ``rotary_dim / 2`` entries.
    """

    def __init__(
        self, head_dim: int, max_position: int, base: float, rope_scaling: Optional[dict] = None, *,
        rotary_dim: Optional[int] = None, is_neox_style: bool = True, num_positions: Optional[int] = None,
    ) -> None:  # fmt: skip
        super().__init__()
        params = dict(rope_scaling or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in _INV_FREQ:
            raise ValueError(f"Unsupported rope_scaling type {rope_type!r}; supported: {', '.join(_INV_FREQ)}.")
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}.")
        self.head_dim, self.rotary_dim, self.is_neox_style = head_dim, rotary_dim, is_neox_style
        num_positions = num_positions or rope_context_len(max_position, {**params, "rope_type": rope_type})
        freqs, attention_factor = _freqs(rope_type, params, float(base), rotary_dim, max_position, num_positions)
        # [num_positions, rotary_dim]: each frequency twice, as the layout pairs channels.
        emb = torch.cat((freqs, freqs), dim=-1) if is_neox_style else freqs.repeat_interleave(2, dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [T, 1, rotary_dim] in ``dtype``, for positions [T] (int64).

        Computed once per forward pass and shared by every layer of this rope.
        """
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    def forward_native(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query`` [T, Hq, head_dim] and ``key`` [T, Hkv, head_dim] by ``cos_sin``'s
        cos / sin (the first ``rotary_dim`` channels): new tensors."""
        rotate = _rotate if self.is_neox_style else _rotate_interleaved
        return _partial(rotate, query, cos, sin), _partial(rotate, key, cos, sin)

    def forward_cpu(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``forward_native``; neox by the C++ kernel in place (``query`` and ``key`` may be
        views of the fused qkv output), returning them."""
        if not self.is_neox_style:
            return self.forward_native(query, key, cos, sin)
        if self.rotary_dim == self.head_dim:
            cpu_kernels.rotary_embedding(query, key, cos.squeeze(1), sin.squeeze(1))
        else:
            rd = self.rotary_dim
            cpu_kernels.rotary_embedding(query[..., :rd], key[..., :rd], cos.squeeze(1), sin.squeeze(1))
        return query, key


def _partial(rotate: Callable, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return rotate(x, cos, sin)
    return torch.cat((rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


def _frozen(value: Any) -> Any:
    """A hashable copy of rope parameters (dicts sorted, lists as tuples)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


_ROPE_CACHE: dict[Any, RotaryEmbedding] = {}


@contextlib.contextmanager
def rope_cache_scope() -> Iterator[None]:
    """Within the block, ``get_rope`` shares modules among the calls made in it only (one
    model's construction: ``get_model``), so a model never holds another's rope, whose
    device, dtype and kernel binding (``CustomOp``, bound at its first call) are that
    other model's."""
    global _ROPE_CACHE
    outer, _ROPE_CACHE = _ROPE_CACHE, {}
    try:
        yield
    finally:
        _ROPE_CACHE = outer


def get_rope(
    head_dim: int, rotary_dim: int, max_position: int, rope_parameters: Optional[dict],
    is_neox_style: bool = True, num_positions: Optional[int] = None,
) -> RotaryEmbedding:  # fmt: skip
    """The ``RotaryEmbedding`` of these parameters (vLLM's ``get_rope``): one module per set
    of arguments and default device, shared by every layer asking for it (of one model,
    inside ``rope_cache_scope``).

    Args:
        head_dim, max_position, is_neox_style, num_positions: as ``RotaryEmbedding``'s.
        rotary_dim: rotating channels, ``int(head_dim * partial_rotary_factor)`` as
            transformers computes it.
        rope_parameters: a layer's ``get_rope_parameters(hf_config, layer_type)`` (its
            ``rope_theta`` is the base; 10000.0 without one), or None: default rope, base 10000.
            With rope parameters per layer type (Gemma 3), whose ``max_position_embeddings``
            is already the scaled length, pass ``num_positions=max_position_embeddings``
            (the engine's ``model_context_len``): the default would scale the table again.

    Raises:
        ValueError: as ``RotaryEmbedding``.
    """
    params = dict(rope_parameters or {})
    key = (head_dim, rotary_dim, max_position, is_neox_style, num_positions, _frozen(params), str(torch.get_default_device()))
    rope = _ROPE_CACHE.get(key)
    if rope is None:
        rope = RotaryEmbedding(
            head_dim, max_position, params.get("rope_theta") or 10000.0, params,
            rotary_dim=rotary_dim, is_neox_style=is_neox_style, num_positions=num_positions,
        )  # fmt: skip
        _ROPE_CACHE[key] = rope
    return rope


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen2-VL's mRoPE; vLLM's ``MRotaryEmbedding``): each token has three
    positions (temporal, height, width; the same three for text), and each rotary frequency
    takes its angle from one of them, as transformers' Qwen-VL ``recomposition_frequencies``:

    - sectioned (Qwen2-VL, Qwen2.5-VL): frequencies ``0 .. s0 - 1`` from t, the next ``s1``
      from h, the next ``s2`` from w (``mrope_section`` [s0, s1, s2], summing to d / 2);
    - interleaved (Qwen3-VL): frequency i from h when ``i % 3 == 1`` and ``i < 3 * s1``, from w
      when ``i % 3 == 2`` and ``i < 3 * s2``, else from t.

    Args:
        mrope_section: [s0, s1, s2] (frequencies per axis).
        interleaved: the layout (see above).
        others: as ``RotaryEmbedding``'s (neox layout, every channel rotating).

    Raises:
        ValueError: a section that is not three counts summing to ``head_dim / 2``; and as
            ``RotaryEmbedding``.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: Optional[dict],
                 mrope_section: list[int], interleaved: bool = False) -> None:
        super().__init__(head_dim, max_position, base, rope_scaling)
        half = head_dim // 2
        if len(mrope_section) != 3 or sum(mrope_section) != half:
            raise ValueError(f"mrope_section {list(mrope_section)} must be three counts summing to head_dim / 2 = {half}.")
        if interleaved:
            index = torch.arange(half)
            axis = torch.zeros(half, dtype=torch.int64)
            axis[(index % 3 == 1) & (index < 3 * mrope_section[1])] = 1
            axis[(index % 3 == 2) & (index < 3 * mrope_section[2])] = 2
        else:
            axis = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        # Channel c of cos / sin takes the angle of axis[c] (both halves alike, neox layout).
        self.register_buffer("axis_of_channel", torch.cat((axis, axis)), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [T, 1, head_dim] in ``dtype``, for positions [3, T] (int64: t, h, w
        rows) or [T] (text: the same position on every axis)."""
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        num_tokens = positions.shape[1]
        index = self.axis_of_channel[None, None, :].expand(1, num_tokens, -1)
        cos = self.cos_cache[positions].gather(0, index)[0]
        sin = self.sin_cache[positions].gather(0, index)[0]
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)
