"""Bidirectional ranges (``CommonAttentionMetadata.bidirectional_ranges``, Gemma 3's image
spans) in ``TORCH_SDPA`` and ``CPU_ATTN`` (at every instruction-set level the kernel tests
run), batched and ``--batch-invariant``, with and without a sliding window, against a float64
reference on a step mixing decodes and chunked prefills: a range inside a whole prompt, one
ending at a chunk's end, one starting in the cached context; the kernel's window ends checked;
and the backend choice (both have them)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pagedllm.attention import selector
from pagedllm.attention.backends.cpu_attn import CpuAttnBackend
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from tests.attention.test_backends import _mixed_step
from tests.helpers import cpu_only

#: (request index, start, end) of ``_mixed_step``'s requests: request 2 is a whole 13-token
#: prompt, 3 a 7-token chunk after 21 cached tokens, 4 a 16-token chunk after 32.
RANGES = np.array([(2, 3, 9), (3, 23, 28), (4, 30, 40)], dtype=np.int64)
SCALE = 0.3


def _reference(query, key, value, kv_cache, common, window):
    """Each token over keys max(0, position - window + 1) .. key end - 1 (its position, or its
    range's end), in float64, after writing the step's K/V."""
    cache = kv_cache.clone()
    block_size = cache.shape[2]
    for t, slot in enumerate(common.slot_mapping.tolist()):
        cache[:, slot // block_size, slot % block_size] = torch.stack([key[t], value[t]])
    token_req, ends = common.tokens_as_decodes()
    key_ends = common.query_key_ends()
    group = query.shape[1] // cache.shape[3]
    out = torch.empty(query.shape, dtype=torch.float64)
    for t in range(common.num_tokens):
        low = 0 if window is None else max(0, int(ends[t]) - window)
        positions = np.arange(low, key_ends[t])
        blocks = common.block_table[token_req[t], positions // block_size]
        keys, values = (cache[i, blocks, positions % block_size].double() for i in (0, 1))  # [L, Hkv, D]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        probs = (torch.einsum("hd,lhd->hl", query[t].double(), keys) * SCALE).softmax(-1)
        out[t] = torch.einsum("hl,lhd->hd", probs, values)
    return out


def test_query_key_ends_reach_each_range_end():
    *_, common = _mixed_step(torch.float32)
    common = dataclasses.replace(common, bidirectional_ranges=RANGES)
    token_req, ends = common.tokens_as_decodes()
    key_ends = common.query_key_ends()
    for req, start, end in RANGES:
        positions = ends[token_req == req] - 1
        expected = np.where((positions >= start) & (positions < end), end, positions + 1)
        assert (key_ends[token_req == req] == expected).all()
    assert (key_ends[token_req < 2] == ends[token_req < 2]).all(), "a decode's keys changed"


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["batched", "per_token"])
@pytest.mark.parametrize("window", [None, 5])
def test_torch_sdpa_attends_both_ways_inside_ranges(window, batch_invariant):
    query, key, value, kv_cache, common = _mixed_step(torch.float32)
    common = dataclasses.replace(common, bidirectional_ranges=RANGES)
    expected = _reference(query, key, value, kv_cache, common, window)
    causal = _reference(query, key, value, kv_cache, dataclasses.replace(common, bidirectional_ranges=None), window)
    assert (expected - causal).abs().max() > 0.1, "the ranges change nothing: the test would not see them ignored"
    builder = TorchSDPABackend.get_builder_cls()(8, torch.device("cpu"), batch_invariant=batch_invariant)
    impl = TorchSDPABackend.get_impl_cls()(6, 64, SCALE, 2, sliding_window=window)
    out = impl.forward(None, query, key, value, kv_cache, builder.build(common))
    assert (out.double() - expected).abs().max() < 1e-5


@cpu_only
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["batched", "per_token"])
@pytest.mark.parametrize("window", [None, 5])
def test_cpu_attn_attends_both_ways_inside_ranges(isa_kernel, window, batch_invariant):
    query, key, value, kv_cache, common = _mixed_step(torch.float32)
    common = dataclasses.replace(common, bidirectional_ranges=RANGES)
    expected = _reference(query, key, value, kv_cache, common, window)
    builder = CpuAttnBackend.get_builder_cls()(8, torch.device("cpu"), batch_invariant=batch_invariant)
    impl = CpuAttnBackend.get_impl_cls()(6, 64, SCALE, 2, sliding_window=window)
    out = impl.forward(None, query, key, value, kv_cache.clone(), builder.build(common))
    assert (out.double() - expected).abs().max() < 1e-5


@cpu_only
def test_kernel_refuses_window_ends_outside_the_context(kernel):
    query, key, value, kv_cache, common = _mixed_step(torch.float32)
    md = CpuAttnBackend.get_builder_cls()(8, torch.device("cpu")).build(
        dataclasses.replace(common, bidirectional_ranges=RANGES))
    out = torch.empty_like(query)
    for bad in (md.seq_lens + 1, torch.zeros_like(md.seq_lens)):
        with pytest.raises(RuntimeError, match="window_end"):
            kernel.paged_decode_attention(out, query, kv_cache[0], kv_cache[1], md.block_table, md.seq_lens, SCALE,
                                          window_ends=bad)


def test_both_backends_attend_both_ways(monkeypatch):
    monkeypatch.delenv(selector.ENV, raising=False)
    assert TorchSDPABackend.missing_features(uses_bidirectional_ranges=True) == []
    assert CpuAttnBackend.missing_features(uses_bidirectional_ranges=True) == []
    assert selector.get_attn_backend(64, torch.float32, 16, "TORCH_SDPA",
                                     uses_bidirectional_ranges=True) is TorchSDPABackend
