"""The decode-attention, cache-write and build_info operators of every level's build, by the
names and schemas the Python side calls them with (``pagedllm.kernels.cpu``), each registered
by the file of its family."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("isa_kernel")

_DECODE_ARGS = ("(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
                "Tensor seq_lens, float scale, float k_scale, float v_scale, int sliding_window=0, "
                "float logits_soft_cap=0., Tensor? sinks=None, int attention_chunk_size=0, "
                "Tensor? window_ends=None) -> ()")
SCHEMAS = {
    "paged_decode_attention": _DECODE_ARGS,
    "paged_decode_attention_portable": _DECODE_ARGS,
    "paged_decode_attention_per_token": _DECODE_ARGS,
    "write_kv_cache": ("(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, "
                       "Tensor slot_mapping, float k_scale, float v_scale) -> ()"),
    "build_info": "() -> str",
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_operator_schema(isa_kernel, name):
    level = isa_kernel.active_isa()
    op = getattr(getattr(torch.ops, f"pagedllm_cpu_{level}"), name)
    assert str(op.default._schema) == f"pagedllm_cpu_{level}::{name}{SCHEMAS[name]}"
