"""Sliding windows, chunked local attention, logits soft-capping and attention sinks (with any
softmax scale) in both backends: the C++ kernel at every instruction-set level the host runs (vector and portable
paths, decode tokens and runs of prefill tokens, GQA, several block sizes, an FP8 cache)
against the float64 reference, TORCH_SDPA and CPU_ATTN on a step mixing decodes and chunked
prefills (also ``--batch-invariant`` and FP8), with the blocks wholly before each request's
window poisoned (NaN contents, invalid ids in the kernel's tables); and the layer's API."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from torch import nn

from pagedllm.attention import selector
from pagedllm.attention.backends import cpu_attn
from pagedllm.attention.backends.cpu_attn import CpuAttnBackend
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend, TorchSDPAImpl
from pagedllm.attention.kv_cache_quant import quantize
from tests.attention.reference import reference_decode_attention
from tests.attention.test_backends import _mixed_step
from tests.helpers import cpu_only

#: Each feature alone and all together; the scale is never head_dim ** -0.5.
FEATURES = {
    "window": {"sliding_window": 7},
    "soft_cap": {"logits_soft_cap": 3.0},
    "sinks": {"sinks": True},
    "all": {"sliding_window": 11, "logits_soft_cap": 5.0, "sinks": True},
}
SCALE = 0.3
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# (num_heads, num_kv_heads, head_dim, block_size): GQA with whole runs, MHA with an odd block
# size, head_dim 80 (AVX-512: portable loops) with blocks of 1, a group of 16 (split in two).
SHAPES = [(8, 2, 64, 16), (4, 4, 32, 5), (6, 2, 80, 1), (16, 1, 64, 8)]
# (cached tokens, scheduled tokens) per request: decodes, a verifying step, chunks crossing
# the window's edge, a prompt from position 0.
REQUESTS = [(40, 1), (3, 1), (30, 5), (9, 12), (0, 14), (25, 1)]


def _sinks(num_heads: int, seed: int) -> torch.Tensor:
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2


def _kernel_args(feature: str, num_heads: int) -> dict:
    args = dict(FEATURES[feature])
    if args.pop("sinks", False):
        args["sinks"] = _sinks(num_heads, 5)
    return args


@functools.lru_cache(maxsize=None)
def _kernel_case(shape: tuple, dtype: torch.dtype, window: int | None, seed: int = 0):
    """Every token as the CPU_ATTN builder lays it out (its request's block table, its
    position + 1); returns the clean (query, cache, table, seq_lens) and the poisoned cache
    and table: per request, the blocks wholly before its first token's window hold NaN, and
    their table entries alternate between such a block and invalid ids (-3, 10**6)."""
    num_heads, num_kv_heads, head_dim, block_size = shape
    gen = torch.Generator().manual_seed(seed)
    width = max(math.ceil((c + n) / block_size) for c, n in REQUESTS) + 1
    num_blocks = len(REQUESTS) * width + 1
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    rows, lens, poisoned_rows = [], [], []
    poisoned = kv_cache.clone()
    for r, (cached, new) in enumerate(REQUESTS):
        row = perm[r * width : (r + 1) * width].clone()
        row[math.ceil((cached + new) / block_size) :] = 0  # padding
        bad = row.clone()
        first = 0 if window is None else max(0, cached + 1 - window) // block_size
        for i in range(first):
            poisoned[:, row[i]] = float("nan")
            bad[i] = (-3, row[i], 10**6)[i % 3]
        for j in range(new):
            rows.append(row)
            poisoned_rows.append(bad)
            lens.append(cached + j + 1)
    table, bad_table = torch.stack(rows), torch.stack(poisoned_rows)
    query = (torch.randn(len(lens), num_heads, head_dim, generator=gen) * 2).to(dtype)
    return query, kv_cache, table, torch.tensor(lens), poisoned, bad_table


@functools.lru_cache(maxsize=None)
def _kernel_expected(shape: tuple, dtype: torch.dtype, feature: str) -> torch.Tensor:
    args = _kernel_args(feature, shape[0])
    query, kv_cache, table, seq_lens, _, _ = _kernel_case(shape, dtype, args.get("sliding_window"))
    return reference_decode_attention(query, kv_cache, table, seq_lens, SCALE, args.get("sliding_window"),
                                      args.get("logits_soft_cap"), args.get("sinks"))


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    assert not actual.isnan().any()
    err = ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()
    assert err <= tolerance, f"relative error {err:.3g} > {tolerance}"


#: Every feature on every shape in float32, and on the first shape in bfloat16.
KERNEL_CASES = [(f, shape, torch.float32) for f in FEATURES for shape in SHAPES] + [
    (f, SHAPES[0], torch.bfloat16) for f in FEATURES
]


@pytest.mark.parametrize("feature,shape,dtype", KERNEL_CASES,
                         ids=lambda c: "Hq{}-Hkv{}-D{}-bs{}".format(*c) if isinstance(c, tuple) else str(c))
def test_kernel_features_match_reference(isa_kernel, feature, shape, dtype):
    """Decodes and runs of prefill tokens, over poisoned out-of-window blocks, on the vector
    path (runs formed; the same bits as token by token) and the portable loops."""
    args = _kernel_args(feature, shape[0])
    query, _, _, seq_lens, poisoned, bad_table = _kernel_case(shape, dtype, args.get("sliding_window"))
    expected = _kernel_expected(shape, dtype, feature)
    outs = {}
    for path in ("runs", "per_token", "portable"):
        out = torch.full_like(query, float("nan"))
        isa_kernel.paged_decode_attention(out, query, poisoned[0], poisoned[1], bad_table, seq_lens, SCALE,
                                          portable=path == "portable", per_token=path == "per_token", **args)
        _assert_close(out, expected, TOLERANCE[dtype])
        outs[path] = out
    assert torch.equal(outs["runs"], outs["per_token"])


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
def test_kernel_features_over_fp8_cache(isa_kernel, fp8, portable):
    """Every feature over an FP8 cache: tight against the float64 reference on the
    dequantized cache."""
    shape, k_scale, v_scale = (8, 2, 64, 16), 0.05, 0.02
    args = _kernel_args("all", shape[0])
    query, kv_cache, table, seq_lens, _, _ = _kernel_case(shape, torch.float32, args["sliding_window"])
    cache = torch.stack([quantize(kv_cache[0], k_scale, fp8), quantize(kv_cache[1], v_scale, fp8)])
    dequantized = torch.stack([cache[0].double() * k_scale, cache[1].double() * v_scale])
    expected = reference_decode_attention(query.double(), dequantized, table, seq_lens, SCALE, args["sliding_window"],
                                          args["logits_soft_cap"], args["sinks"])
    out = torch.empty_like(query)
    isa_kernel.paged_decode_attention(out, query, cache[0], cache[1], table, seq_lens, SCALE, k_scale, v_scale,
                                      portable=portable, **args)
    _assert_close(out, expected, 2e-5)


def test_kernel_rejects_bad_feature_arguments(kernel):
    query, kv_cache, table, seq_lens, _, _ = _kernel_case(SHAPES[0], torch.float32, None)
    out = torch.empty_like(query)
    call = functools.partial(kernel.paged_decode_attention, out, query, kv_cache[0], kv_cache[1], table, seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="sliding_window must be >= 0"):
        call(sliding_window=-2)
    with pytest.raises(RuntimeError, match="logits_soft_cap must be >= 0"):
        call(logits_soft_cap=-1.0)
    with pytest.raises(RuntimeError, match="sinks must be a contiguous float32 CPU tensor \\[num_heads\\]"):
        call(sinks=torch.zeros(3))


# --- both backends on a step of decodes and chunked prefills --------------------------------

BACKEND_FEATURES = {**FEATURES, "none": {}}
BACKENDS = [pytest.param("CPU_ATTN", marks=cpu_only), "TORCH_SDPA"]


class _Layer(nn.Module):
    """What an impl reads of its layer: sinks and FP8 scales."""

    def __init__(self, sinks, k_scale: float = 1.0, v_scale: float = 1.0):
        super().__init__()
        self.sinks, self.k_scale_float, self.v_scale_float = sinks, k_scale, v_scale


def _poison_before_windows(kv_cache: torch.Tensor, common, window: int | None) -> torch.Tensor:
    """``kv_cache`` with NaN in each request's blocks wholly before its first token's window
    (what a KV-cache manager may have freed and given away)."""
    poisoned = kv_cache.clone()
    if window is None:
        return poisoned
    block_size = kv_cache.shape[2]
    for r in range(common.num_reqs):
        for i in range(max(0, int(common.num_computed_tokens[r]) + 1 - window) // block_size):
            poisoned[:, common.block_table[r, i]] = float("nan")
    return poisoned


@functools.lru_cache(maxsize=None)
def _backend_case(feature: str, dtype: torch.dtype, fp8=None):
    """The mixed step's (query, key, value, cache, common), the impl's arguments, the layer's
    sinks and FP8 scales, and the float64 reference's output. The cache has NaN in the blocks
    before each request's window (none over FP8: its reference reads the quantized values)."""
    args = dict(BACKEND_FEATURES[feature])
    window = args.get("sliding_window")
    sinks = _sinks(6, 9) if args.pop("sinks", False) else None
    query, key, value, kv_cache, common = _mixed_step(dtype)
    scales, reference_cache = (1.0, 1.0), kv_cache
    if fp8 is not None:
        scales = (0.05, 0.02)
        key = quantize(key, scales[0], fp8).double().mul(scales[0]).to(dtype)
        value = quantize(value, scales[1], fp8).double().mul(scales[1]).to(dtype)
        context = kv_cache.nan_to_num(0.0)
        kv_cache = torch.stack([quantize(context[0], scales[0], fp8), quantize(context[1], scales[1], fp8)])
        reference_cache = torch.stack([kv_cache[0].double() * scales[0], kv_cache[1].double() * scales[1]]).to(dtype)
    else:
        kv_cache = _poison_before_windows(kv_cache, common, window)
    expected = _expected_on(query, key, value, reference_cache, common, (window, args.get("logits_soft_cap"), sinks))
    return (query, key, value, kv_cache, common), args, sinks, scales, expected


def _backend_step(request, name: str, feature: str, dtype: torch.dtype, batch_invariant: bool = False, fp8=None):
    """(output, expected) of one impl forward on the mixed step (6 heads over 2 kv heads);
    CPU_ATTN's needs the kernels (``kernel`` fixture)."""
    if name == "CPU_ATTN":
        request.getfixturevalue("kernel")
    (query, key, value, kv_cache, common), args, sinks, scales, expected = _backend_case(feature, dtype, fp8)
    backend = selector.get_attn_backend(64, dtype, 8, name)
    metadata = backend.get_builder_cls()(8, torch.device("cpu"), batch_invariant=batch_invariant).build(common)
    impl = backend.get_impl_cls()(6, 64, SCALE, 2, **args)
    out = impl.forward(_Layer(sinks, *scales), query, key, value, kv_cache.clone(), metadata)
    return out, expected


def _expected_on(query, key, value, kv_cache, common, expected_args):
    window, soft_cap, sinks = expected_args
    cache = kv_cache.clone()
    block_size = cache.shape[2]
    for t, slot in enumerate(common.slot_mapping.tolist()):
        cache[0, slot // block_size, slot % block_size] = key[t]
        cache[1, slot // block_size, slot % block_size] = value[t]
    token_req, seq_lens = common.tokens_as_decodes()
    table = torch.from_numpy(common.block_table[token_req])
    return reference_decode_attention(query, cache, table, torch.from_numpy(seq_lens), SCALE, window, soft_cap, sinks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("feature", list(BACKEND_FEATURES))
@pytest.mark.parametrize("name", BACKENDS)
def test_backend_features_on_mixed_step(request, name, feature, dtype):
    """Decodes and chunked prefills over NaN blocks before each request's window."""
    out, expected = _backend_step(request, name, feature, dtype)
    _assert_close(out, expected, TOLERANCE[dtype])


@pytest.mark.parametrize("feature", ["window", "all"])
@pytest.mark.parametrize("name", BACKENDS)
def test_backend_features_batch_invariant(request, name, feature):
    """``--batch-invariant`` (every token alone): the same results."""
    out, expected = _backend_step(request, name, feature, torch.float32, batch_invariant=True)
    _assert_close(out, expected, TOLERANCE[torch.float32])


@pytest.mark.parametrize("name,widened", [pytest.param("CPU_ATTN", False, marks=cpu_only),
                                          pytest.param("CPU_ATTN", True, marks=cpu_only), ("TORCH_SDPA", False)],
                         ids=["CPU_ATTN", "CPU_ATTN-widened", "TORCH_SDPA"])
def test_backend_features_over_fp8_cache(request, name, widened, monkeypatch):
    """Over an FP8 cache; CPU_ATTN also with its prefill contexts widened once per layer."""
    if widened:
        monkeypatch.setattr(cpu_attn, "FP8_WIDEN_MIN_QUERY_LEN", 1)
    out, expected = _backend_step(request, name, "all", torch.float32, fp8=torch.float8_e4m3fn)
    _assert_close(out, expected, 2e-5)


CHUNK = 12  # the mixed step's requests cross chunk boundaries at 12, 24 and 36


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["batched", "batch_invariant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", BACKENDS)
def test_chunked_local_attention_on_mixed_step(request, name, dtype, batch_invariant):
    """Decodes and chunked prefills crossing chunk boundaries, each query over its own aligned
    chunk only, the blocks wholly before each request's first query's chunk holding NaN (what
    the KV-cache manager freed)."""
    if name == "CPU_ATTN":
        request.getfixturevalue("kernel")
    query, key, value, kv_cache, common = _mixed_step(dtype)
    poisoned = kv_cache.clone()
    for r in range(common.num_reqs):
        first = int(common.num_computed_tokens[r])
        for i in range((first - first % CHUNK) // 8):
            poisoned[:, common.block_table[r, i]] = float("nan")
    cache = kv_cache.clone()
    for t, slot in enumerate(common.slot_mapping.tolist()):
        cache[0, slot // 8, slot % 8], cache[1, slot // 8, slot % 8] = key[t], value[t]
    token_req, seq_lens = common.tokens_as_decodes()
    table, lens = torch.from_numpy(common.block_table[token_req]), torch.from_numpy(seq_lens)
    expected = reference_decode_attention(query, cache, table, lens, SCALE, chunk=CHUNK)
    backend = selector.get_attn_backend(64, dtype, 8, name, uses_chunked_local_attention=True)
    metadata = backend.get_builder_cls()(8, torch.device("cpu"), batch_invariant=batch_invariant).build(common)
    impl = backend.get_impl_cls()(6, 64, SCALE, 2, attention_chunk_size=CHUNK)
    out = impl.forward(_Layer(None), query, key, value, poisoned, metadata)
    _assert_close(out, expected, TOLERANCE[dtype])
    whole = reference_decode_attention(query, cache, table, lens, SCALE)
    assert not torch.allclose(out.float(), whole.float(), atol=0.1)  # the chunks change the output


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_kernel_chunked_local_attention_matches_reference(isa_kernel, chunk):
    """Every instruction-set level, decodes and runs of prefill tokens (GQA group 4), over
    NaN blocks and invalid ids before each token's chunk."""
    gen = torch.Generator().manual_seed(chunk)
    num_heads, num_kv_heads, head_dim, block_size, width = 8, 2, 64, 4, 10
    seq_lens = torch.tensor([37, 38, 39, 40, 9, 1, 17], dtype=torch.int64)  # a run of 4 crossing 36 / 40
    contexts = [0, 0, 0, 0, 1, 2, 3]  # the run's tokens share one context; the others have their own
    kv_cache = torch.randn(2, 4 * width, block_size, num_kv_heads, head_dim, generator=gen)
    blocks = torch.randperm(4 * width, generator=gen).view(4, width)  # disjoint blocks per context
    table = blocks[contexts]
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    expected = reference_decode_attention(query, kv_cache, table, seq_lens, SCALE, chunk=chunk)
    poisoned, bad_table = kv_cache.clone(), table.clone()
    for b, n in enumerate(seq_lens.tolist()):
        first = min((m - 1) - (m - 1) % chunk for m, c in zip(seq_lens.tolist(), contexts) if c == contexts[b])
        for i in range(first // block_size):  # before every token of this context's chunk
            poisoned[:, table[b, i]] = float("nan")
            bad_table[b, i] = -3 if i % 2 else 10**6
    out = torch.empty_like(query)
    isa_kernel.paged_decode_attention(out, query, poisoned[0], poisoned[1], bad_table, seq_lens, SCALE,
                                      attention_chunk_size=chunk)
    _assert_close(out, expected, TOLERANCE[torch.float32])


def test_chunked_local_attention_arguments_are_checked(kernel):
    query = torch.zeros(1, 2, 16)
    cache = torch.zeros(2, 4, 4, 1, 16)
    call = functools.partial(kernel.paged_decode_attention, torch.empty_like(query), query, cache[0], cache[1],
                             torch.zeros(1, 4, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 1.0)
    with pytest.raises(RuntimeError, match="attention_chunk_size must be >= 0"):
        call(attention_chunk_size=-1)
    with pytest.raises(RuntimeError, match="sliding_window and attention_chunk_size cannot both be set"):
        call(sliding_window=4, attention_chunk_size=8)


def test_chunked_local_attention_impl_arguments():
    with pytest.raises(ValueError, match="either a sliding_window or an attention_chunk_size"):
        TorchSDPAImpl(6, 64, SCALE, 2, sliding_window=8, attention_chunk_size=16)
    with pytest.raises(ValueError, match="attention_chunk_size must be a positive number of tokens"):
        TorchSDPAImpl(6, 64, SCALE, 2, attention_chunk_size=0)
    assert not CpuAttnBackend.missing_features(uses_chunked_local_attention=True)
    assert not TorchSDPABackend.missing_features(uses_chunked_local_attention=True)


# --- the layer, the impls and the selector ---------------------------------------------------


def test_layer_keeps_the_models_sinks_without_owning_them():
    """vLLM's ``Attention(..., sinks=)``: the model's parameter, read by the impl at each
    forward; not a parameter of the layer (it loads under the model's name only)."""
    from pagedllm.model_executor.layers.attention import Attention

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = nn.Parameter(torch.zeros(4))
            self.attn = Attention(4, 32, 2, 0.1, sliding_window=8, logits_soft_cap=30.0, sinks=self.sinks)

    with selector.set_attn_backend(TorchSDPABackend):
        block = Block()
    assert [name for name, _ in block.named_parameters()] == ["sinks"]
    assert "attn.sinks" not in block.state_dict()
    assert block.attn.sinks is block.sinks and TorchSDPAImpl.layer_sinks(block.attn) is block.sinks
    assert (block.attn.impl.sliding_window, block.attn.impl.logits_soft_cap) == (8, 30.0)
    with selector.set_attn_backend(TorchSDPABackend):
        assert Attention(4, 32, 2, 0.1, logits_soft_cap=0).impl.logits_soft_cap is None  # vLLM: 0 is none
        with pytest.raises(ValueError, match=r"sinks must be a floating-point tensor of shape \(4,\)"):
            Attention(4, 32, 2, 0.1, sinks=torch.zeros(2))
        with pytest.raises(ValueError, match="logits_soft_cap must be a positive finite number"):
            Attention(4, 32, 2, 0.1, logits_soft_cap=-1.0)


class _PlainImpl(TorchSDPAImpl):
    supports_sliding_window = supports_logits_soft_cap = supports_sinks = False


class _PlainBackend(TorchSDPABackend):
    name = "PLAIN_TEST"
    impl_cls = _PlainImpl


@pytest.mark.parametrize("feature,kwarg,what", [
    ("uses_sliding_window", {"sliding_window": 8}, "sliding-window attention"),
    ("uses_logits_soft_cap", {"logits_soft_cap": 30.0}, "logits soft-capping"),
    ("has_sinks", {"sinks": torch.zeros(4)}, "attention sinks"),
])
def test_backend_lacking_a_feature_is_passed_over(feature, kwarg, what, monkeypatch):
    """Both built-in backends have every feature; one without says so, and the automatic
    choice takes the next."""
    from pagedllm.model_executor.layers.attention import Attention

    monkeypatch.delenv(selector.ENV, raising=False)
    for backend in (CpuAttnBackend, TorchSDPABackend):
        assert backend.missing_features(True, True, True) == []
    monkeypatch.setitem(selector._registry, "PLAIN_TEST", _PlainBackend)
    monkeypatch.setattr(type(selector.current_platform), "attn_backend_preference", ("PLAIN_TEST", "TORCH_SDPA"))
    assert selector.get_attn_backend(64, torch.float32, 16) is _PlainBackend
    assert selector.get_attn_backend(64, torch.float32, 16, **{feature: True}) is TorchSDPABackend
    with pytest.raises(ValueError, match=f"PLAIN_TEST cannot run here: it has no {what}, which the model uses"):
        selector.get_attn_backend(64, torch.float32, 16, "PLAIN_TEST", **{feature: True})
    with selector.set_attn_backend(_PlainBackend):
        with pytest.raises(ValueError, match=f"PLAIN_TEST has no {what}, which this layer uses"):
            Attention(4, 32, 2, 0.1, **kwarg)
