"""``argmax_rows`` (the CPU greedy-sampling kernel) equals ``torch.argmax(dim=-1)``,
including ties, NaN, -inf rows, short rows and strided rows; the sampler uses it."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers.sampler import Argmax


pytestmark = pytest.mark.usefixtures("isa_kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 32000])
def test_random_rows(dtype, vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(19, vocab).to(dtype)
    assert torch.equal(cpu_kernels.argmax_rows(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_nan_and_infinities(dtype):
    logits = torch.zeros(5, 40, dtype=dtype)
    logits[0, [5, 17, 39]] = 2.0  # ties: the first index wins
    logits[1] = float("-inf")  # all -inf: index 0
    logits[2, 3], logits[2, 25] = 9.0, float("nan")  # NaN wins, as in torch
    logits[3, 30], logits[3, 2] = float("nan"), float("nan")  # the first NaN
    logits[4, 38] = float("inf")
    expected = logits.float().argmax(dim=-1)
    assert expected.tolist() == [5, 0, 25, 2, 38]
    assert torch.equal(cpu_kernels.argmax_rows(logits), expected)


def test_strided_rows_and_sampler():
    torch.manual_seed(0)
    wide = torch.randn(6, 100, dtype=torch.bfloat16)
    logits = wide[:, :64]  # rows 100 apart
    assert torch.equal(cpu_kernels.argmax_rows(logits), logits.argmax(dim=-1))
    assert torch.equal(Argmax()(logits), logits.float().argmax(dim=-1))


def test_bad_input():
    with pytest.raises(RuntimeError, match="must be \\[B, V\\]"):
        cpu_kernels.argmax_rows(torch.randn(3))
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        cpu_kernels.argmax_rows(torch.randn(2, 3, dtype=torch.float64))
