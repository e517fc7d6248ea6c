"""Attention backends behind one interface: the selector (automatic, forced by name or by
environment, errors), every registered backend against a float64 reference on a step mixing
decodes and chunked prefills over a paged cache, and a backend registered from outside
being used by the model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedllm.attention import selector
from pagedllm.attention.backends.abstract import CommonAttentionMetadata
from pagedllm.attention.backends.cpu_attn import CpuAttnBackend
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend, TorchSDPAImpl
from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.platforms import current_platform
from tests.attention.reference import reference_decode_attention
from tests.helpers import cpu_only, model_runner

BACKENDS = ["CPU_ATTN", "TORCH_SDPA"]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(selector.ENV, raising=False)
    monkeypatch.delenv(cpu_kernels.DISABLE_ENV, raising=False)


def test_both_backends_registered():
    assert selector.registered_attn_backends()[:2] == BACKENDS


@cpu_only
def test_auto_selection_prefers_the_kernel_on_cpu(kernel, no_env, disable_cpu_kernels):
    assert selector.get_attn_backend(64, torch.bfloat16, 16) is CpuAttnBackend
    disable_cpu_kernels()
    assert selector.get_attn_backend(64, torch.bfloat16, 16) is TorchSDPABackend


@cpu_only
def test_forced_by_name_or_environment(kernel, no_env, monkeypatch):
    assert selector.get_attn_backend(64, torch.float32, 16, "torch_sdpa") is TorchSDPABackend
    assert selector.get_attn_backend(64, torch.float32, 16, "CPU_ATTN") is CpuAttnBackend
    monkeypatch.setenv(selector.ENV, "TORCH_SDPA")
    assert selector.get_attn_backend(64, torch.float32, 16) is TorchSDPABackend
    assert selector.get_attn_backend(64, torch.float32, 16, "CPU_ATTN") is CpuAttnBackend  # the flag wins


def test_unknown_name_lists_the_registered(no_env):
    with pytest.raises(ValueError, match="Unknown attention backend 'FLASH_ATTN'; registered backends: CPU_ATTN, TORCH_SDPA"):
        selector.get_attn_backend(64, torch.float32, 16, "FLASH_ATTN")


class _Only16(TorchSDPABackend):
    name = "ONLY_16_TEST"

    @staticmethod
    def get_supported_block_sizes() -> tuple[int, ...]:
        return (16,)


def test_unsupported_configuration_is_refused(no_env, monkeypatch):
    with pytest.raises(ValueError, match="TORCH_SDPA cannot run here: dtype float64 is not supported"):
        selector.get_attn_backend(64, torch.float64, 16, "TORCH_SDPA")
    monkeypatch.setitem(selector._registry, "ONLY_16_TEST", _Only16)
    assert selector.get_attn_backend(64, torch.float32, 16, "ONLY_16_TEST") is _Only16
    with pytest.raises(ValueError, match="block size 8 is not supported \\(supported: 16\\)"):
        selector.get_attn_backend(64, torch.float32, 8, "ONLY_16_TEST")


def test_mla_models_run_on_an_mla_backend_only(no_env):
    from pagedllm.attention.backends.torch_mla import TorchMLABackend

    assert selector.get_attn_backend(40, torch.float32, 16, use_mla=True) is TorchMLABackend
    assert selector.get_attn_backend(40, torch.float32, 16, "torch_mla", use_mla=True) is TorchMLABackend
    with pytest.raises(ValueError, match="TORCH_SDPA cannot run here: the model's attention is MLA"):
        selector.get_attn_backend(40, torch.float32, 16, "TORCH_SDPA", use_mla=True)
    with pytest.raises(ValueError, match="TORCH_MLA cannot run here: it runs MLA only"):
        selector.get_attn_backend(64, torch.float32, 16, "TORCH_MLA")
    with pytest.raises(ValueError, match="TORCH_MLA cannot run here: kv_cache_dtype fp8 is not supported"):
        selector.get_attn_backend(40, torch.float32, 16, "TORCH_MLA", kv_cache_dtype="fp8", use_mla=True)


def _mixed_step(dtype: torch.dtype, block_size: int = 8, num_heads: int = 6, num_kv_heads: int = 2, head_dim: int = 64):
    """A step of 2 decodes, a whole 13-token prompt, a 7-token chunk after 21 cached tokens
    and a 16-token chunk after 32 (ending on a block boundary); block tables are random,
    non-contiguous blocks padded with block 0, which no request owns. Every slot not written
    by a request's context or this step holds NaN."""
    gen = torch.Generator().manual_seed(3)
    requests = [(30, 1), (9, 1), (0, 13), (21, 7), (32, 16)]  # (cached tokens, scheduled tokens)
    num_blocks = 48
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(math.ceil((c + n) / block_size) for c, n in requests) + 1
    table = np.zeros((len(requests), width), dtype=np.int64)
    slots = []
    for r, (cached, new) in enumerate(requests):
        used = math.ceil((cached + new) / block_size)
        table[r, :used] = perm[:used]
        perm = perm[used:]
        for p in range(cached):  # the context already in the cache
            block, offset = table[r, p // block_size], p % block_size
            kv_cache[:, block, offset] = torch.randn(2, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots += [int(table[r, p // block_size]) * block_size + p % block_size for p in range(cached, cached + new)]
    num_tokens = len(slots)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    query_lens = np.array([n for _, n in requests])
    common = CommonAttentionMetadata(
        query_start_loc=np.concatenate(([0], np.cumsum(query_lens))),
        seq_lens=np.array([c + n for c, n in requests]),
        num_computed_tokens=np.array([c for c, _ in requests]),
        block_table=table,
        slot_mapping=np.array(slots),
        num_decodes=2,
    )
    return query, key, value, kv_cache, common


def _reference(query, key, value, kv_cache, common, scale, window=None):
    """Each token as a decode query over its request's context up to itself (its last
    ``window`` positions), after writing the step's K/V slot by slot."""
    cache = kv_cache.clone()
    block_size = cache.shape[2]
    for t, slot in enumerate(common.slot_mapping.tolist()):
        cache[0, slot // block_size, slot % block_size] = key[t]
        cache[1, slot // block_size, slot % block_size] = value[t]
    query_lens = np.diff(common.query_start_loc)
    token_req = np.repeat(np.arange(common.num_reqs), query_lens)
    positions = common.num_computed_tokens[token_req] + np.arange(common.num_tokens) - common.query_start_loc[token_req]
    table = torch.from_numpy(common.block_table[token_req])
    return reference_decode_attention(query, cache, table, torch.from_numpy(positions + 1), scale, window), cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", [pytest.param("CPU_ATTN", marks=cpu_only), "TORCH_SDPA"])
def test_backend_matches_reference_on_mixed_step(name, dtype, kernel):
    backend = selector.get_attn_backend(64, dtype, 8, name)
    query, key, value, kv_cache, common = _mixed_step(dtype)
    scale = 64**-0.5
    expected, expected_cache = _reference(query, key, value, kv_cache, common, scale)
    metadata = backend.get_builder_cls()(8, torch.device("cpu")).build(common)
    impl = backend.get_impl_cls()(6, 64, scale, 2)
    out = impl.forward(None, query, key, value, kv_cache, metadata)
    assert out.shape == query.shape and out.dtype == dtype and not out.isnan().any()
    err = ((out.double() - expected.double()).abs().max() / expected.double().abs().max()).item()
    assert err <= TOLERANCE[dtype], f"relative error {err:.3g}"
    assert torch.equal(kv_cache.nan_to_num(7.0), expected_cache.nan_to_num(7.0))  # K/V written to their slots


def test_kv_cache_shape():
    for backend in (CpuAttnBackend, TorchSDPABackend):
        assert backend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)


class _RecordingImpl(TorchSDPAImpl):
    calls = 0

    def forward(self, layer, query, key, value, kv_cache, attn_metadata):
        type(self).calls += 1
        return super().forward(layer, query, key, value, kv_cache, attn_metadata)


class _RecordingBackend(TorchSDPABackend):
    name = "RECORDING_TEST"
    impl_cls = _RecordingImpl


def test_registered_backend_is_used_by_the_model(tiny_llama, no_env, monkeypatch):
    from pagedllm import LLM, SamplingParams

    monkeypatch.setattr(selector, "_registry", dict(selector._registry))
    selector.register_attn_backend(_RecordingBackend)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": list(range(40, 75))}]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    def generate(name):
        llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=4 << 20, attention_backend=name)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        return model_runner(llm), outputs

    runner, recorded = generate("recording_test")
    assert runner.attn_backend is _RecordingBackend
    assert all(layer.attn_backend is _RecordingBackend for layer in runner.attention_layers)
    assert _RecordingImpl.calls >= len(runner.attention_layers) * 5  # every layer, every step
    assert recorded == generate("TORCH_SDPA")[1]


def test_engine_start_fails_clearly_for_an_unknown_backend(tiny_llama, no_env):
    from pagedllm import LLM

    with pytest.raises(ValueError, match="Unknown attention backend 'NOPE'; registered backends: CPU_ATTN"):
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=4 << 20, attention_backend="NOPE")


@pytest.mark.parametrize("window", [1, 7, 8, 9, 22])
def test_torch_sdpa_sliding_window_matches_reference(window):
    """A query at position i sees keys i - W + 1 .. i (transformers' ``sliding_window_overlay``):
    decodes at positions 30 and 9, and prefill chunks whose queries cross position W - 1,
    W and W + 1 (the 13-token prompt for W 7-9; the chunks after 21 and 32 cached for 22)."""
    query, key, value, kv_cache, common = _mixed_step(torch.float32)
    scale = 64**-0.5
    expected, _ = _reference(query, key, value, kv_cache, common, scale, window)
    full, _ = _reference(query, key, value, kv_cache, common, scale)
    metadata = TorchSDPABackend.get_builder_cls()(8, torch.device("cpu")).build(common)
    out = TorchSDPAImpl(6, 64, scale, 2, sliding_window=window).forward(None, query, key, value, kv_cache, metadata)
    assert (out - expected).abs().max().item() <= 1e-5
    assert (full - expected).abs().max().item() > 1e-2  # the window hides keys in this step
    # A layer without a window in the same step still sees everything (masks kept apart).
    out_full = TorchSDPAImpl(6, 64, scale, 2).forward(None, query, key, value, kv_cache, metadata)
    assert (out_full - full).abs().max().item() <= 1e-5


def test_sliding_window_backend_choice(no_env):
    """Both backends have windows: the automatic choice for a windowed model is the usual
    one (CPU_ATTN on CPU with the kernels), and its impl takes a window."""
    assert TorchSDPABackend.supports_sliding_window() and CpuAttnBackend.supports_sliding_window()
    expected = CpuAttnBackend if current_platform.is_cpu and cpu_kernels.is_available() else TorchSDPABackend
    assert selector.get_attn_backend(64, torch.float32, 16, uses_sliding_window=True) is expected
    assert CpuAttnBackend.get_impl_cls()(6, 64, 0.125, 2, sliding_window=16).sliding_window == 16
    with pytest.raises(ValueError, match="sliding_window must be a positive number of tokens"):
        CpuAttnBackend.get_impl_cls()(6, 64, 0.125, 2, sliding_window=0)
    with selector.set_attn_backend(CpuAttnBackend):
        assert selector.get_current_attn_backend(uses_sliding_window=True) is CpuAttnBackend


def test_attention_layer_takes_the_backend_it_is_built_with():
    """No silent automatic choice (which ignored block size and KV-cache dtype): a layer
    built outside ``set_attn_backend`` is an error, one built inside holds that backend."""
    from pagedllm.model_executor.layers.attention import Attention

    with pytest.raises(RuntimeError, match="No attention backend set: build models inside selector.set_attn_backend"):
        Attention(4, 32, 2, 0.2)
    with selector.set_attn_backend(TorchSDPABackend):
        layer = Attention(4, 32, 2, 0.2)
    assert layer.attn_backend is TorchSDPABackend
    assert isinstance(layer.impl, TorchSDPABackend.get_impl_cls())
