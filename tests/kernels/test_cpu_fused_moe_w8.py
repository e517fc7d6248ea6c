"""``fused_moe_w8`` (a layer's routed int8 experts in one call: ``pack_experts``' int8 blocks,
per-channel float32 scales) equals the grouped torch compute with float64 experts on the
dequantized weights (scale[:, None] * Q), at every instruction-set level the host supports:
batch 1 and 40-row prefills, top-k 1 / 2 / 8, experts with no tokens, ragged hidden and
intermediate sizes, SwiGLU and ungated squared-ReLU experts, biases, float32 and 16-bit inputs.
Its sums do not depend on the number of threads; bad input is refused clearly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model_executor.layers.fused_moe.expert_groups import ExpertGroups, fused_experts, group_by_expert
from pagedllm.model_executor.layers.quantization.int8 import quantize_int8_per_channel
from tests.grids import latin_grid
from tests.kernels.test_cpu_fused_moe import _problem as float_problem

# (tokens, experts, top-k): batch 1; prefills of 40 rows; many experts with few or no tokens.
ROUTINGS = [(1, 16, 2), (40, 8, 2), (40, 16, 8), (7, 32, 1), (1, 64, 8)]
# (hidden, intermediate): multiples of the block and ragged ones.
SHAPES = [(64, 32), (40, 24), (33, 17)]
# (x dtype, activation, bias)
KINDS = [(torch.float32, "silu", False), (torch.bfloat16, "silu", True), (torch.float32, "relu2_no_mul", True),
         (torch.float16, "relu2_no_mul", False), (torch.float32, "silu", True)]


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> (Q [E, N, K] int8, scale [E, N] float32), per expert and channel."""
    parts = [quantize_int8_per_channel(m) for m in w]
    return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])


def _problem(tokens, experts, top_k, hidden, inter, x_dtype, activation, bias, seed):
    """test_cpu_fused_moe's float32 problem with one all-zero channel (scale 1, Q 0), its
    experts quantized per channel."""
    x, w13, w2, b13, b2, groups = float_problem(tokens, experts, top_k, hidden, inter, torch.float32, x_dtype,
                                                activation, bias, seed)
    w13[1, 3] = 0.0
    return x, (*_quantize(w13), *_quantize(w2)), b13, b2, groups


def _reference(x, quantized, b13, b2, groups: ExpertGroups, activation) -> torch.Tensor:
    """fused_experts with each dequantized expert in float64 (then float32)."""
    q13, s13, q2, s2 = quantized
    w13 = q13.double() * s13.double()[..., None]
    w2 = q2.double() * s2.double()[..., None]
    inter = w2.shape[2]

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = rows.double() @ w13[e].T + (0 if b13 is None else b13[e].double())
        a = F.silu(h[:, :inter]) * h[:, inter:] if activation == "silu" else F.relu(h) ** 2
        return (a @ w2[e].T + (0 if b2 is None else b2[e].double())).float()

    return fused_experts(x.float(), groups, expert)


def _run(kernel, x, quantized, b13, b2, groups, activation):
    q13, s13, q2, s2 = quantized
    return kernel.fused_moe_w8(x, groups.token_rows, groups.weights, groups.counts, kernel.pack_experts(q13),
                               kernel.pack_experts(q2), s13, s2, activation, b13, b2)


@pytest.mark.parametrize("routing,shape,kind", latin_grid(ROUTINGS, SHAPES, KINDS))
def test_equals_dequantized_float64_experts(isa_kernel, routing, shape, kind):
    (tokens, experts, top_k), (hidden, inter), (x_dtype, activation, bias) = routing, shape, kind
    x, quantized, b13, b2, groups = _problem(tokens, experts, top_k, hidden, inter, x_dtype, activation, bias,
                                             seed=tokens * 7 + experts + hidden)
    assert groups.counts[0] == 0 and sum(groups.counts) == tokens * top_k
    got = _run(isa_kernel, x, quantized, b13, b2, groups, activation)
    assert got.shape == x.shape and got.dtype == x.dtype
    expected = _reference(x, quantized, b13, b2, groups, activation)
    # float32 sums over H then I terms; a 16-bit output adds one rounding.
    tol = 2e-5 if x_dtype == torch.float32 else torch.finfo(x_dtype).eps
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol * float(expected.abs().max()))


def test_int8_pack_layout(isa_kernel):
    """Expert e's int8 element (n, k) at [e, n // 16, k, n % 16]; the padding is zero."""
    q = torch.randint(-127, 128, (3, 37, 5), dtype=torch.int8)
    packed = isa_kernel.pack_experts(q)
    assert packed.shape == (3, 3, 5, 16) and packed.dtype == torch.int8
    e, n, k = torch.meshgrid(torch.arange(3), torch.arange(37), torch.arange(5), indexing="ij")
    assert torch.equal(packed[e, n // 16, k, n % 16], q)
    assert not packed[:, 2, :, 5:].any()


def test_same_bits_with_one_and_two_threads(isa_kernel):
    """Each output is summed expert by expert in id order, each product in a fixed order."""
    x, quantized, b13, b2, groups = _problem(40, 16, 8, 64, 32, torch.float32, "silu", True, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(isa_kernel, x, quantized, b13, b2, groups, "silu")
        torch.set_num_threads(2)
        two = _run(isa_kernel, x, quantized, b13, b2, groups, "silu")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_no_pairs_give_zeros(kernel):
    """Expert parallelism can leave a rank no pairs at all."""
    x, quantized, _, _, _ = _problem(3, 4, 1, 32, 16, torch.bfloat16, "silu", False, seed=1)
    empty = ExpertGroups(torch.zeros(0, dtype=torch.int64), torch.zeros(0), [0, 0, 0, 0])
    got = _run(kernel, x, quantized, None, None, empty, "silu")
    assert got.dtype == torch.bfloat16 and torch.equal(got, torch.zeros_like(x))


def test_bad_input_is_refused(kernel):
    x, (q13, s13, q2, s2), _, _, groups = _problem(3, 4, 2, 32, 16, torch.float32, "silu", False, seed=2)
    p13, p2 = kernel.pack_experts(q13), kernel.pack_experts(q2)
    rows, weights, counts = groups.token_rows, groups.weights, groups.counts

    def call(*, w13=p13, w2=p2, scale13=s13, scale2=s2, activation="silu", xs=x, cs=counts, bias13=None):
        return kernel.fused_moe_w8(xs, rows, weights, cs, w13, w2, scale13, scale2, activation, bias13, None)

    with pytest.raises(RuntimeError, match="fused_moe_w8: w13 and w2 must be contiguous CPU tensors of one dtype \\(int8\\)"):
        call(w13=kernel.pack_experts(q13.float()), w2=kernel.pack_experts(q2.float()))
    with pytest.raises(RuntimeError, match="one dtype \\(int8\\)"):
        call(w2=kernel.pack_experts(q2.float()))
    with pytest.raises(RuntimeError, match="one dtype \\(bfloat16 / float16 / float32\\)"):  # int8 without scales
        kernel.fused_moe(x, rows, weights, counts, p13, p2, "silu", None, None)
    with pytest.raises(RuntimeError, match="w13_scale must be a float32 CPU tensor \\[4, 32\\]"):
        call(scale13=s13[:, :31])
    with pytest.raises(RuntimeError, match="w2_scale must be a float32 CPU tensor \\[4, 32\\]"):
        call(scale2=s2.double())
    with pytest.raises(RuntimeError, match='activation must be "silu" or "relu2_no_mul"'):
        call(activation="swigluoai")
    with pytest.raises(RuntimeError, match="do not fit x's hidden size 31"):
        call(xs=x[:, :31])
    with pytest.raises(RuntimeError, match="3 counts for 4 experts"):
        call(cs=counts[:3])
    with pytest.raises(RuntimeError, match="w13_bias must be a CPU tensor \\[4, 32\\]"):
        call(bias13=torch.zeros(4, 31))
