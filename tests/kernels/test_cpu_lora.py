"""``lora_sgmv`` (the multi-LoRA shrink / expand of one layer in one call) adds to each token
of a run its slot's update, rounded to y's dtype as ``LoRALinearMethod``'s PyTorch path
rounds it, at every instruction-set level the host supports: several runs of one slot,
tokens of no run untouched, runs longer than a tile of 4 tokens, A and B in float32 or in x's dtype, slices wider than a block of
256 columns and not multiples of it, ranks padded with zeros; bad input is refused."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.usefixtures("isa_kernel")

# (K, output slices, padded rank R)
SHAPES = [(128, [32, 16, 16], 4), (96, [300, 300], 8), (896, [1152], 16), (40, [7], 3)]


def _reference(y, x, lora_a, lora_b, groups, sizes):
    """The same arithmetic in float64 per run and slice, rounded as the kernel rounds."""
    out = y.clone()
    rank = lora_b.shape[1]
    offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    for slot, start, end in groups.tolist():
        xa = x[start:end].double() @ lora_a[slot].double()
        for j, (offset, size) in enumerate(zip(offsets, sizes)):
            delta = xa[:, j * rank : (j + 1) * rank] @ lora_b[slot, :, offset : offset + size].double()
            out[start:end, offset : offset + size] = (
                out[start:end, offset : offset + size].double() + delta.to(y.dtype).double()
            ).to(y.dtype)
    return out


@pytest.mark.parametrize("k,sizes,rank", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("weights_in", ["float32", "x_dtype"])
def test_matches_per_run_reference(k, sizes, rank, dtype, weights_in):
    """A and B in float32 or in the model's dtype (read widened, summed in float32)."""
    if weights_in == "x_dtype" and dtype == torch.float32:
        pytest.skip("the same case as float32 weights")
    gen = torch.Generator().manual_seed(k + rank)
    num_slots, n = 3, sum(sizes)
    weight_dtype = torch.float32 if weights_in == "float32" else dtype
    lora_a = (torch.randn(num_slots, k, len(sizes) * rank, generator=gen) * 0.1).to(weight_dtype)
    lora_b = (torch.randn(num_slots, rank, n, generator=gen) * 0.1).to(weight_dtype)
    lora_b[1, rank // 2 :] = 0  # slot 1: an adapter of lower rank, zero-padded
    # 30 tokens: slot 0 twice, slot 2 for 11 tokens (more than one tile), tokens 12-14 and 29 without.
    groups = torch.tensor([[0, 0, 5], [2, 5, 12], [1, 15, 16], [0, 16, 29]], dtype=torch.int64)
    x = torch.randn(30, k, generator=gen).to(dtype)
    y = torch.randn(30, n, generator=gen).to(dtype)
    expected = _reference(y, x, lora_a, lora_b, groups, sizes)
    got = y.clone()
    cpu_kernels.lora_sgmv(got, x, lora_a, lora_b, groups, sizes)
    torch.testing.assert_close(got[12:15], y[12:15], rtol=0, atol=0)
    torch.testing.assert_close(got[29], y[29], rtol=0, atol=0)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


def test_no_groups_changes_nothing():
    y = torch.randn(4, 8)
    got = y.clone()
    cpu_kernels.lora_sgmv(got, torch.randn(4, 16), torch.randn(2, 16, 4), torch.randn(2, 4, 8),
                          torch.empty(0, 3, dtype=torch.int64), [8])
    assert torch.equal(got, y)


@pytest.mark.parametrize("groups,sizes,weight_dtype,match", [
    ([[2, 0, 1]], [8], torch.float32, "out of range"),            # slot 2 of 2
    ([[0, 3, 9]], [8], torch.float32, "out of range"),            # past the last token
    ([[0, 0, 1]], [4, 3], torch.float32, "sum to y's width"),
    ([[0, 0, 1]], [8], torch.bfloat16, "float32 or both x's dtype"),  # bf16 A/B, float32 x
])
def test_bad_input_is_refused(groups, sizes, weight_dtype, match):
    with pytest.raises(RuntimeError, match=match):
        cpu_kernels.lora_sgmv(torch.randn(4, 8), torch.randn(4, 16),
                              torch.randn(2, 16, 4 * len(sizes)).to(weight_dtype), torch.randn(2, 4, 8).to(weight_dtype),
                              torch.tensor(groups, dtype=torch.int64), sizes)
