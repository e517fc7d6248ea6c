"""The C++ CPU decode-attention kernel against a float64 reference, the CPU_ATTN backend
over it, and the fallback to TORCH_SDPA where the kernels are unavailable.

Kernel tests fail (with the reason) where the extension cannot be built (the ``kernel``
fixture of tests/conftest.py); the fallback tests run everywhere.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys

import pytest
import torch

from pagedllm.attention import selector
from pagedllm.attention.backends.cpu_attn import CpuAttnBackend, CpuAttnMetadata
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.kernels.cpu import build as cpu_build
from pagedllm.kernels.cpu import runtime as cpu_runtime
from pagedllm.kernels import isa
from tests.attention.reference import reference_decode_attention

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (batch, num_heads, num_kv_heads, head_dim, block_size): group sizes 1..16 (above 8 the
# vector path splits the group), head_dim multiple of 32, of 16 only (bf16 takes the float32
# products), and not of 16 (portable loops), block sizes 1..32 (tiles of 16 tokens span
# several blocks or part of one).
SHAPES = [
    (5, 4, 2, 64, 16),
    (4, 14, 2, 64, 16),
    (3, 8, 8, 128, 8),
    (3, 8, 1, 32, 32),
    (3, 10, 1, 64, 1),
    (2, 16, 1, 16, 16),
    (3, 6, 2, 80, 16),
    (3, 4, 4, 24, 4),
    (2, 9, 3, 48, 5),
    (2, 20, 1, 24, 16),
    (2, 2, 1, 256, 16),
]


def _seq_lens(batch: int, block_size: int, max_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """1, block and tile boundaries, the full table, then random lengths."""
    cap = max_blocks * block_size
    special = [1, cap, block_size, block_size + 1, 16, 17, 2 * block_size]
    lens = [min(x, cap) for x in special] + torch.randint(1, cap + 1, (batch,), generator=gen).tolist()
    return torch.tensor(lens[:batch], dtype=torch.int64)


def _case(batch, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, max_blocks=None):
    """Random cache, queries and padded block tables. Slots past each seq_len hold large
    finite garbage; table entries past each request's blocks are padding (block 0)."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max_blocks or max(2, 70 // block_size + 1)
    num_blocks = batch * max_blocks + 3
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    seq_lens = _seq_lens(batch, block_size, max_blocks, gen)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(batch, max_blocks + 2, dtype=torch.int64)  # 2 extra padding columns
    for b, n in enumerate(seq_lens.tolist()):
        used = math.ceil(n / block_size)
        blocks = perm[b * max_blocks : b * max_blocks + used]
        table[b, :used] = blocks
        # Garbage in the unused tail of the last block.
        tail = used * block_size - n
        if tail:
            kv_cache[:, blocks[-1], block_size - tail :] = 1e4
    query = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    return query, kv_cache, table, seq_lens


def _reference(query, kv_cache, table, seq_lens, scale):
    return reference_decode_attention(query, kv_cache, table, seq_lens, scale)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any()
    err = ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()
    assert err <= TOLERANCE[dtype], f"relative error {err:.3g} > {TOLERANCE[dtype]}"


# The vector path on every shape and dtype; the portable loops (which every shape the vector
# path does not take also runs) on every shape, the dtypes in turn.
PATH_CASES = [(shape, dtype, "vector") for shape in SHAPES for dtype in DTYPES] + [
    (shape, DTYPES[i % len(DTYPES)], "portable") for i, shape in enumerate(SHAPES)
]


@pytest.mark.parametrize(
    "shape,dtype,path", PATH_CASES, ids=lambda c: "B{}-Hq{}-Hkv{}-D{}-bs{}".format(*c) if isinstance(c, tuple) else str(c)
)
def test_kernel_matches_torch_path(isa_kernel, shape, dtype, path):
    query, kv_cache, table, seq_lens = _case(*shape, dtype)
    scale = shape[3] ** -0.5
    expected = _reference(query, kv_cache, table, seq_lens, scale)
    out = torch.full_like(query, float("nan"))
    isa_kernel.paged_decode_attention(out, query, kv_cache[0], kv_cache[1], table, seq_lens, scale,
                                  portable=path == "portable")
    _assert_close(out, expected, dtype)



def _runs_case(num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Query tokens as CPU_ATTN's builder lays out a step: per request, its tokens in a row,
    each with the request's block table and its own position + 1 as length. Requests: a
    verifying step (5 tokens), a decode, a 12-token chunk crossing blocks, a decode whose
    length follows the previous token's (another table: not one run), a prompt from
    position 0. Each token's table past its own blocks is padding that differs (-1)."""
    gen = torch.Generator().manual_seed(seed)
    requests = [(40, 5), (23, 1), (block_size - 3, 12), (block_size + 10, 1), (0, 7)]
    max_blocks = max(math.ceil((start + count) / block_size) for start, count in requests) + 1
    num_blocks = len(requests) * max_blocks + 2
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables, lens = [], []
    for r, (start, count) in enumerate(requests):
        blocks = perm[r * max_blocks : (r + 1) * max_blocks]
        for j in range(count):
            n = start + j + 1
            row = blocks.clone()
            row[math.ceil(n / block_size) :] = -1
            tables.append(row)
            lens.append(n)
    lens[len(lens) - 8] = lens[len(lens) - 9] + 1  # the decode after the chunk: consecutive length
    table, seq_lens = torch.stack(tables), torch.tensor(lens, dtype=torch.int64)
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    return query, kv_cache, table, seq_lens


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 2, 64, 16), (8, 8, 128, 8), (8, 2, 64, 16), (3, 3, 48, 5), (14, 2, 64, 16),
                                   (4, 1, 32, 32)], ids=lambda s: "Hq{}-Hkv{}-D{}-bs{}".format(*s))
def test_kernel_runs_of_tokens_over_one_context(isa_kernel, shape, dtype):
    """Consecutive tokens over one context (a prompt chunk, a verifying step's 1 + k) are
    computed together on the vector paths (up to 8 / G per run): each still attends to its
    own positions only, as the float64 reference, and as the kernel does token by token."""
    query, kv_cache, table, seq_lens = _runs_case(*shape, dtype)
    scale = shape[2] ** -0.5
    out = torch.full_like(query, float("nan"))
    isa_kernel.paged_decode_attention(out, query, kv_cache[0], kv_cache[1], table, seq_lens, scale)
    _assert_close(out, _reference(query, kv_cache, table.clamp_min(0), seq_lens, scale), dtype)
    one_by_one = torch.cat([_one_token(isa_kernel, query, kv_cache, table, seq_lens, scale, b) for b in range(len(query))])
    assert torch.equal(out, one_by_one)


def _one_token(kernel, query, kv_cache, table, seq_lens, scale, b):
    out = torch.empty_like(query[b : b + 1])
    kernel.paged_decode_attention(out, query[b : b + 1], kv_cache[0], kv_cache[1], table[b : b + 1],
                                  seq_lens[b : b + 1], scale)
    return out

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_per_token_computes_each_token_alone(isa_kernel, dtype):
    """``per_token`` (``--batch-invariant``) forms no runs: every token's output is the
    kernel's for that token alone, and the float64 reference's within rounding."""
    query, kv_cache, table, seq_lens = _runs_case(8, 2, 64, 16, dtype, seed=3)
    scale = 64**-0.5
    out = torch.full_like(query, float("nan"))
    isa_kernel.paged_decode_attention(out, query, kv_cache[0], kv_cache[1], table, seq_lens, scale, per_token=True)
    one_by_one = torch.cat([_one_token(isa_kernel, query, kv_cache, table, seq_lens, scale, b) for b in range(len(query))])
    assert torch.equal(out, one_by_one)
    _assert_close(out, _reference(query, kv_cache, table.clamp_min(0), seq_lens, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_never_reads_past_seq_len(isa_kernel, dtype):
    """NaN beyond each seq_len in its last block, and invalid ids in the table's padding,
    change nothing: those positions are never read."""
    query, kv_cache, table, seq_lens = _case(6, 8, 2, 64, 16, dtype, seed=3)
    expected = torch.empty_like(query)
    isa_kernel.paged_decode_attention(expected, query, kv_cache[0], kv_cache[1], table, seq_lens, 0.125)
    poisoned, bad_table = kv_cache.clone(), table.clone()
    for b, n in enumerate(seq_lens.tolist()):
        used = math.ceil(n / 16)
        last = table[b, used - 1]
        poisoned[:, last, n - (used - 1) * 16 :] = float("nan")
        bad_table[b, used:] = -1
    for portable in (False, True):
        out = torch.empty_like(query)
        isa_kernel.paged_decode_attention(out, query, poisoned[0], poisoned[1], bad_table, seq_lens, 0.125,
                                      portable=portable)
        if not portable:
            assert torch.equal(out, expected)
        else:
            _assert_close(out, expected, dtype)


def test_kernel_strided_query_and_out(isa_kernel):
    """Query and out may be row slices of larger tensors (as in paged_attention)."""
    query, kv_cache, table, seq_lens = _case(4, 6, 2, 64, 16, torch.bfloat16, seed=5)
    big_q = torch.randn(7, 6, 64).to(torch.bfloat16)
    big_q[:4] = query
    big_out = torch.zeros(7, 6, 64, dtype=torch.bfloat16)
    isa_kernel.paged_decode_attention(big_out[:4], big_q[:4], kv_cache[0], kv_cache[1], table, seq_lens, 0.125)
    _assert_close(big_out[:4], _reference(query, kv_cache, table, seq_lens, 0.125), torch.bfloat16)
    assert torch.count_nonzero(big_out[4:]) == 0


def test_kernel_same_result_on_one_and_two_threads(isa_kernel):
    query, kv_cache, table, seq_lens = _case(9, 14, 2, 64, 16, torch.bfloat16, seed=7)
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.empty_like(query)
            isa_kernel.paged_decode_attention(out, query, kv_cache[0], kv_cache[1], table, seq_lens, 0.125)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_kernel_rejects_bad_inputs(isa_kernel):
    query, kv_cache, table, seq_lens = _case(2, 4, 2, 32, 16, torch.float32)
    out = torch.empty_like(query)
    bad = table.clone()
    bad[0, 0] = kv_cache.shape[1]
    with pytest.raises(RuntimeError, match="block id"):
        isa_kernel.paged_decode_attention(out, query, kv_cache[0], kv_cache[1], bad, seq_lens, 1.0)
    too_long = seq_lens.clone()
    too_long[1] = table.shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match="seq_len"):
        isa_kernel.paged_decode_attention(out, query, kv_cache[0], kv_cache[1], table, too_long, 1.0)
    with pytest.raises(RuntimeError, match="one dtype"):
        isa_kernel.paged_decode_attention(out, query.double(), kv_cache[0], kv_cache[1], table, seq_lens, 1.0)


def test_cpu_attn_impl_uses_kernel(kernel, monkeypatch):
    query, kv_cache, table, seq_lens = _case(4, 4, 2, 32, 16, torch.float32, seed=11)
    calls = []
    real = cpu_kernels.paged_decode_attention
    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    impl = CpuAttnBackend.get_impl_cls()(4, 32, 0.2, 2)
    expected = _reference(query, kv_cache, table, seq_lens, 0.2)
    metadata = CpuAttnMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), num_decodes=4, num_prefills=0,
                               block_table=table, seq_lens=seq_lens)
    empty = torch.empty(0, 2, 32)
    out = impl.forward(None, query, empty, empty, kv_cache, metadata)
    assert calls
    _assert_close(out, expected, torch.float32)


def test_disable_env_selects_torch_sdpa(monkeypatch, disable_cpu_kernels):
    disable_cpu_kernels()
    monkeypatch.delenv(selector.ENV, raising=False)
    assert not cpu_kernels.is_available()
    assert selector.get_attn_backend(64, torch.float32, 16) is TorchSDPABackend
    with pytest.raises(ValueError, match="CPU_ATTN cannot run here: .*disabled"):
        selector.get_attn_backend(64, torch.float32, 16, "CPU_ATTN")
    with pytest.raises(RuntimeError, match="disabled"):
        cpu_kernels.build_info()


def test_build_failure_falls_back_with_one_warning(monkeypatch, caplog, disable_cpu_kernels):
    disable_cpu_kernels(False)
    monkeypatch.delenv(selector.ENV, raising=False)
    monkeypatch.setattr(cpu_runtime, "_active", None)
    monkeypatch.setattr(cpu_runtime, "_error", None)
    monkeypatch.setattr(cpu_runtime, "_builds", {})
    attempts = []

    def failing_build(name, cflags, ldflags):
        attempts.append(name)
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(cpu_build, "_load_locked", failing_build)
    monkeypatch.setattr(cpu_build, "_load_built", lambda library: False)  # and no cached build to load
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        for _ in range(3):
            assert selector.get_attn_backend(32, torch.float32, 16) is TorchSDPABackend
    # each level from the selected one down to portable was tried once, and never again
    levels = isa.LEVELS[: isa.LEVELS.index(isa.selected_isa()) + 1]
    tag = f"_v{cpu_build._KERNEL_VERSION}_"
    assert [name.split(tag)[1].rsplit("_", 1)[0] for name in attempts] == list(reversed(levels))
    warnings = [r for r in caplog.records if r.name == cpu_kernels.__name__]
    assert len(warnings) == 1 and "no C++ compiler here" in warnings[0].getMessage()
    with pytest.raises(ValueError, match="no C\\+\\+ compiler here"):
        selector.get_attn_backend(32, torch.float32, 16, "CPU_ATTN")


def test_import_does_not_build():
    code = (
        "import pagedllm, pagedllm.attention.selector, pagedllm.model_executor.layers.attention\n"
        "from pagedllm.kernels.cpu import runtime\n"
        "import torch\n"
        "assert runtime._active is None and runtime._error is None and not runtime._builds\n"
        "for level in ('portable', 'avx2', 'avx512', 'avx512_bf16'):\n"
        "    assert not hasattr(getattr(torch.ops, 'pagedllm_cpu_' + level), 'paged_decode_attention')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_engine_greedy_same_with_and_without_kernel(kernel, tiny_qwen2, monkeypatch, disable_cpu_kernels):
    """Decode through the kernel (spied) and through the fallback give the same tokens."""
    from pagedllm import LLM, SamplingParams

    prompts = [[5, 17, 99, 3], list(range(40, 75)), [7] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def generate():
        llm = LLM(str(tiny_qwen2), dtype="float32", block_size=8, kv_cache_memory_bytes=4 << 20)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    calls = []
    real = cpu_kernels.paged_decode_attention
    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with_kernel = generate()
    assert calls, "the engine did not use the kernel"
    disable_cpu_kernels()
    assert generate() == with_kernel
