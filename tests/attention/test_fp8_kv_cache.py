"""The FP8 KV cache at the attention level: quantization (saturating, exact on FP8 values),
the C++ kernel reading float8 e4m3 / e5m2 blocks at every instruction-set level (exactly
widened: tight against a float64 reference on the dequantized cache), and both backends
writing and reading an FP8 cache on a step mixing decodes and chunked prefills."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import selector
from pagedllm.attention.backends import cpu_attn
from pagedllm.attention.kv_cache_quant import calculate_kv_scales, dequantize, quantize, widen
from pagedllm.attention.paged_kv_cache import write_to_kv_cache
from tests.attention.reference import reference_decode_attention
from pagedllm.platforms import current_platform
from tests.attention.test_backends import _mixed_step
from tests.attention.test_cpu_paged_attention import SHAPES, _case
from tests.helpers import cpu_only

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
#: Relative error against float64 on the same (dequantized) cache: float32 math, and the
#: output's rounding for 16-bit queries.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _fp8_cache(kv_cache: torch.Tensor, fp8: torch.dtype, k_scale: float, v_scale: float) -> torch.Tensor:
    """``kv_cache`` quantized with the scales (the garbage past each context included)."""
    return torch.stack([quantize(kv_cache[0], k_scale, fp8), quantize(kv_cache[1], v_scale, fp8)])


def _dequantized(cache: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    return torch.stack([cache[0].double() * k_scale, cache[1].double() * v_scale])


def test_quantize_saturates_and_round_trips():
    x = torch.tensor([1000.0, -1000.0, 0.3, -2.5, 0.0, float("nan")])
    e4m3 = quantize(x, 2.0, torch.float8_e4m3fn)
    assert e4m3.float()[:5].tolist() == [448.0, -448.0, 0.15625, -1.25, 0.0] and e4m3.float()[5].isnan()
    assert quantize(torch.tensor([1e6, -1e6]), 1.0, torch.float8_e5m2).float().tolist() == [57344.0, -57344.0]
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = every[~every.float().isnan()]
    assert torch.equal(quantize(dequantize(finite, 0.5, torch.float32), 0.5, torch.float8_e4m3fn).view(torch.uint8),
                       finite.view(torch.uint8))


@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_widen_is_exact_for_every_byte(fp8):
    every = torch.arange(256, dtype=torch.uint8).view(fp8)
    finite = every.float().isfinite()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out, factor = widen(every, dtype)
        assert out.dtype == dtype and torch.equal(out.float()[finite] * factor, every.float()[finite])


def test_calculate_kv_scales_is_amax_over_vllm_constants():
    key, value = torch.tensor([[0.5, -8.0]]), torch.tensor([[3.0, 1.0]])
    assert calculate_kv_scales(key, value) == (8.0 / 200, 3.0 / 100)
    assert calculate_kv_scales(torch.zeros(2, 2), value)[0] == 1.0  # nothing to scale by


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
def test_kernel_widens_every_fp8_value_exactly(isa_kernel, fp8, dtype, portable):
    """Each request attends to one token, so its output is that token's V row: every one of
    the 256 byte values (NaN bytes zeroed) read back as float(fp8) x v_scale, exactly (head
    size 32: bfloat16 queries take the vdpbf16ps path where the build has it)."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8)
    values = torch.where(values.float().isfinite(), values.float(), 0.0).to(fp8)
    value_cache = values.view(8, 1, 1, 32)  # 8 blocks of 1 token, head_dim 32
    key_cache = torch.zeros_like(value_cache.view(torch.uint8)).view(fp8)
    query = torch.randn(8, 2, 32).to(dtype)
    out = torch.empty_like(query)
    table = torch.arange(8).view(8, 1)
    isa_kernel.paged_decode_attention(out, query, key_cache, value_cache, table, torch.ones(8, dtype=torch.int64),
                                      0.25, 1.0, 0.5, portable=portable)
    assert torch.equal(out.float(), (values.float().view(8, 1, 32) * 0.5).expand(8, 2, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("shape", SHAPES[:6] + SHAPES[-3:], ids=lambda s: "B{}-Hq{}-Hkv{}-D{}-bs{}".format(*s))
@pytest.mark.parametrize("path", ["vector", "portable"])
def test_kernel_on_fp8_cache_matches_float64_reference(isa_kernel, shape, fp8, dtype, path):
    query, kv_cache, table, seq_lens = _case(*shape, torch.float32, seed=2)
    query = query.to(dtype)
    k_scale, v_scale = 0.05, 0.02
    cache = _fp8_cache(kv_cache, fp8, k_scale, v_scale)
    scale = shape[3] ** -0.5
    expected = reference_decode_attention(query.double(), _dequantized(cache, k_scale, v_scale), table, seq_lens, scale)
    out = torch.full_like(query, float("nan"))
    isa_kernel.paged_decode_attention(out, query, cache[0], cache[1], table, seq_lens, scale, k_scale, v_scale,
                                      portable=path == "portable")
    assert not out.isnan().any()
    err = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    assert err <= TOLERANCE[dtype], f"relative error {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_kernel_cache_write_is_torchs_quantization(isa_kernel, fp8, dtype):
    """write_kv_cache stores the bytes of quantize (torch's rounding): every float16 value,
    values spread over 30 binades (subnormal, saturating, infinite and NaN ones included),
    at two scales; keys and values to their slots."""
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(20000, generator=gen) * torch.exp(torch.randn(20000, generator=gen) * 6)
    special = torch.tensor([448.0, 464.0, 480.0, -500.0, 57344.0, 61440.0, 1e30, float("inf"), -float("inf"),
                            float("nan"), 2**-10, 2**-17, 0.0, -0.0, 3 * 2**-10, 5 * 2**-18])  # fmt: skip
    halves = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    x = torch.cat([halves, spread, special]).to(dtype)
    x = x[: x.numel() // 64 * 64].view(-1, 2, 32)
    slots = torch.randperm(x.shape[0] + 7, generator=gen)[: x.shape[0]]
    for scale in (1.0, 0.37):
        cache = torch.zeros(2, x.shape[0] + 7, 1, 2, 32, dtype=torch.uint8).view(fp8)
        isa_kernel.write_kv_cache(cache[0], cache[1], x, -x, slots, scale, 2 * scale)
        expected = torch.zeros_like(cache.view(torch.uint8)).view(fp8)
        write_to_kv_cache(expected, x, -x, slots, scale, 2 * scale)
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def test_kernel_rejects_a_cache_of_another_dtype(kernel):
    query, kv_cache, table, seq_lens = _case(2, 4, 2, 32, 16, torch.float32)
    out = torch.empty_like(query)
    with pytest.raises(RuntimeError, match="float8_e4m3fn, float8_e5m2"):
        kernel.paged_decode_attention(out, query, kv_cache[0].half(), kv_cache[1].half(), table, seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="float8_e4m3fn, float8_e5m2"):
        kernel.write_kv_cache(kv_cache[0].half(), kv_cache[1].half(), query[:, :2], query[:, :2],
                              torch.zeros(2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="slot 99999 of token 1 out of range"):
        kernel.write_kv_cache(kv_cache[0], kv_cache[1], query[:, :2], query[:, :2], torch.tensor([0, 99999]))


class _Scales:
    """Stands in for the ``Attention`` layer: its FP8 scales."""

    k_scale_float, v_scale_float = 0.04, 0.03


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("name, widened", [pytest.param("CPU_ATTN", False, marks=cpu_only),
                                           pytest.param("CPU_ATTN", True, marks=cpu_only), ("TORCH_SDPA", False)],
                         ids=["CPU_ATTN", "CPU_ATTN-widened", "TORCH_SDPA"])
def test_backend_writes_and_reads_an_fp8_cache(name, widened, fp8, kernel, monkeypatch):
    """Both backends quantize the step's K/V into their slots and attend over the FP8
    context as a float64 reference does over the dequantized cache (on the platform's
    device: torch's float8 types on CUDA). CPU_ATTN also with its prefill contexts widened
    once per layer (its threshold lowered for this step's short prefills)."""
    if widened:
        monkeypatch.setattr(cpu_attn, "FP8_WIDEN_MIN_QUERY_LEN", 1)
    device = current_platform.device
    backend = selector.get_attn_backend(64, torch.float32, 8, name, kv_cache_dtype="fp8")
    query, key, value, kv_cache, common = _mixed_step(torch.float32)
    layer = _Scales()
    cache = _fp8_cache(kv_cache, fp8, layer.k_scale_float, layer.v_scale_float)
    expected_cache = cache.clone()
    write_to_kv_cache(expected_cache, key, value, torch.from_numpy(common.slot_mapping),
                      layer.k_scale_float, layer.v_scale_float)
    metadata = backend.get_builder_cls()(8, device).build(common)
    assert (getattr(metadata, "prefill_blocks", None) is not None) == widened
    if widened:  # contexts past the cap are left to the kernel
        with monkeypatch.context() as patch:
            patch.setattr(cpu_attn, "FP8_WIDEN_MAX_CONTEXT_TOKENS", 8)
            assert backend.get_builder_cls()(8, device).build(common).prefill_blocks is None
    device_cache = cache.to(device)
    out = backend.get_impl_cls()(6, 64, 64**-0.5, 2).forward(
        layer, query.to(device), key.to(device), value.to(device), device_cache, metadata
    ).cpu()
    cache = device_cache.cpu()
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
    query_lens = common.query_start_loc[1:] - common.query_start_loc[:-1]
    token_req = torch.repeat_interleave(torch.arange(common.num_reqs), torch.from_numpy(query_lens))
    positions = torch.from_numpy(common.num_computed_tokens)[token_req] + torch.arange(common.num_tokens) - \
        torch.from_numpy(common.query_start_loc)[token_req]
    dequantized = torch.nan_to_num(_dequantized(cache, layer.k_scale_float, layer.v_scale_float), 0.0)
    expected = reference_decode_attention(query.double(), dequantized, torch.from_numpy(common.block_table)[token_req],
                                          positions + 1, 64**-0.5)
    assert not out.isnan().any()
    err = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    assert err <= 1e-5, f"relative error {err:.3g}"
