"""``fused_moe`` (every routed expert of a layer in one call, from ``pack_experts``' blocks)
equals the grouped torch compute (``expert_groups.fused_experts``) with float64 experts, at
every instruction-set level the host supports: batch 1 and a 40-row prefill, top-k 1 / 2 / 8,
experts with no tokens, hidden and intermediate sizes that are not multiples of the 16-output
blocks, SwiGLU and ungated squared-ReLU experts, biases, 16-bit and float32 weights and
inputs. Its sums do not depend on the number of threads; bad input is refused clearly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model_executor.layers.fused_moe.expert_groups import ExpertGroups, fused_experts, group_by_expert
from tests.grids import latin_grid

# (tokens, experts, top-k): batch 1; a prefill of 40 rows; many experts with few or no tokens.
ROUTINGS = [(1, 16, 2), (40, 8, 2), (40, 16, 8), (7, 32, 1), (1, 64, 8)]
# (hidden, intermediate): multiples of the block and ragged ones.
SHAPES = [(64, 32), (40, 24), (33, 17)]
# (weight dtype, x dtype, activation, bias)
KINDS = [(torch.bfloat16, torch.bfloat16, "silu", False), (torch.float16, torch.float32, "silu", True),
         (torch.float32, torch.float32, "relu2_no_mul", False), (torch.bfloat16, torch.float32, "relu2_no_mul", True),
         (torch.float32, torch.float16, "silu", False)]


def _problem(tokens, experts, top_k, hidden, inter, w_dtype, x_dtype, activation, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    n13 = 2 * inter if activation == "silu" else inter
    w13 = (torch.randn(experts, n13, hidden, generator=gen) / hidden**0.5).to(w_dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(w_dtype)
    b13 = torch.randn(experts, n13, generator=gen) if bias else None
    b2 = torch.randn(experts, hidden, generator=gen) if bias else None
    x = torch.randn(tokens, hidden, generator=gen).to(x_dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 0] = -1e4  # expert 0 never chosen: a zero count before the first active expert
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k)
    return x, w13, w2, b13, b2, group_by_expert(weights, ids, experts)


def _reference(x, w13, w2, b13, b2, groups: ExpertGroups, activation) -> torch.Tensor:
    """fused_experts with each expert in float64 (then float32): the exact result to compare with."""
    inter = w2.shape[2]

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = rows.double() @ w13[e].double().T + (0 if b13 is None else b13[e].double())
        a = F.silu(h[:, :inter]) * h[:, inter:] if activation == "silu" else F.relu(h) ** 2
        return (a @ w2[e].double().T + (0 if b2 is None else b2[e].double())).float()

    return fused_experts(x.float(), groups, expert)


def _run(kernel, x, w13, w2, b13, b2, groups, activation):
    return kernel.fused_moe(x, groups.token_rows, groups.weights, groups.counts, kernel.pack_experts(w13),
                            kernel.pack_experts(w2), activation, b13, b2)


@pytest.mark.parametrize("routing,shape,kind", latin_grid(ROUTINGS, SHAPES, KINDS))
def test_equals_grouped_torch_experts(isa_kernel, routing, shape, kind):
    (tokens, experts, top_k), (hidden, inter), (w_dtype, x_dtype, activation, bias) = routing, shape, kind
    x, w13, w2, b13, b2, groups = _problem(tokens, experts, top_k, hidden, inter, w_dtype, x_dtype, activation, bias,
                                           seed=tokens * 7 + experts + hidden)
    assert groups.counts[0] == 0 and sum(groups.counts) == tokens * top_k
    got = _run(isa_kernel, x, w13, w2, b13, b2, groups, activation)
    assert got.shape == x.shape and got.dtype == x.dtype
    expected = _reference(x, w13, w2, b13, b2, groups, activation)
    # float32 sums over H then I terms; a 16-bit output adds one rounding.
    tol = 2e-5 if x_dtype == torch.float32 else torch.finfo(x_dtype).eps
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol * float(expected.abs().max()))


def test_pack_layout(isa_kernel):
    """Expert e's element (n, k) at [e, n // 16, k, n % 16]; the last block's padding is zero."""
    w = torch.randn(3, 37, 5).to(torch.bfloat16)
    packed = isa_kernel.pack_experts(w)
    assert packed.shape == (3, 3, 5, 16) and packed.dtype == torch.bfloat16
    e, n, k = torch.meshgrid(torch.arange(3), torch.arange(37), torch.arange(5), indexing="ij")
    assert torch.equal(packed[e, n // 16, k, n % 16], w)
    assert not packed[:, 2, :, 5:].any()
    w32 = torch.randn(2, 16, 8)
    assert torch.equal(isa_kernel.pack_experts(w32)[1, 0], w32[1].T)  # float32 too


def test_same_bits_whatever_the_number_of_threads(isa_kernel):
    """Each output is summed expert by expert in id order, each product in a fixed order."""
    x, w13, w2, b13, b2, groups = _problem(40, 16, 8, 64, 32, torch.bfloat16, torch.float32, "silu", True, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(isa_kernel, x, w13, w2, b13, b2, groups, "silu")
        torch.set_num_threads(max(2, threads))
        many = _run(isa_kernel, x, w13, w2, b13, b2, groups, "silu")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_no_pairs_give_zeros(kernel):
    """Expert parallelism can leave a rank no pairs at all."""
    x, w13, w2, _, _, _ = _problem(3, 4, 1, 32, 16, torch.bfloat16, torch.bfloat16, "silu", False, seed=1)
    empty = ExpertGroups(torch.zeros(0, dtype=torch.int64), torch.zeros(0), [0, 0, 0, 0])
    got = _run(kernel, x, w13, w2, None, None, empty, "silu")
    assert got.dtype == torch.bfloat16 and torch.equal(got, torch.zeros_like(x))


def test_bad_input_is_refused(kernel):
    x, w13, w2, _, _, groups = _problem(3, 4, 2, 32, 16, torch.bfloat16, torch.bfloat16, "silu", False, seed=2)
    p13, p2 = kernel.pack_experts(w13), kernel.pack_experts(w2)
    rows, weights, counts = groups.token_rows, groups.weights, groups.counts
    with pytest.raises(RuntimeError, match="bfloat16 / float16 / float32 / int8 CPU tensor \\[E, N, K\\]"):
        kernel.pack_experts(w13[0])
    with pytest.raises(RuntimeError, match='activation must be "silu" or "relu2_no_mul"'):
        kernel.fused_moe(x, rows, weights, counts, p13, p2, "swigluoai", None, None)
    with pytest.raises(RuntimeError, match="do not fit x's hidden size 31"):
        kernel.fused_moe(x[:, :31], rows, weights, counts, p13, p2, "silu", None, None)
    with pytest.raises(RuntimeError, match="do not fit"):  # a gated W13 read as ungated
        kernel.fused_moe(x, rows, weights, counts, p13, p2, "relu2_no_mul", None, None)
    with pytest.raises(RuntimeError, match="3 counts for 4 experts"):
        kernel.fused_moe(x, rows, weights, counts[:3], p13, p2, "silu", None, None)
    with pytest.raises(RuntimeError, match="token_rows must be an int64 CPU tensor of the counts' sum \\(6\\)"):
        kernel.fused_moe(x, rows[:5], weights, counts, p13, p2, "silu", None, None)
    with pytest.raises(RuntimeError, match="token_rows must index x's 3 rows"):
        kernel.fused_moe(x, rows + 3, weights, counts, p13, p2, "silu", None, None)
    with pytest.raises(RuntimeError, match="weights must be a float32"):
        kernel.fused_moe(x, rows, weights.double(), counts, p13, p2, "silu", None, None)
    with pytest.raises(RuntimeError, match="packed by pack_experts"):
        kernel.fused_moe(x, rows, weights, counts, w13, p2, "silu", None, None)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel.fused_moe(x, rows, weights, counts, p13, p2.float(), "silu", None, None)
    with pytest.raises(RuntimeError, match="w13_bias must be a CPU tensor \\[4, 32\\]"):
        kernel.fused_moe(x, rows, weights, counts, p13, p2, "silu", torch.zeros(4, 31), None)
