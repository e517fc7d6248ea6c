"""The rejection sampler keeps the target distribution (chi-square on a small vocabulary,
fixed seeds: deterministic, so never flaky) for arbitrary target p and draft q, and the
matching rule keeps a deterministic proposal's prefix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagedllm.spec_decode.rejection_sampler import num_accepted_matching, rejection_sample

VOCAB = 6
NUM_TRIALS = 6000


def _dirichlet(seed: int, rows: int, alpha: float) -> torch.Tensor:
    """[rows, VOCAB] float32 random distributions."""
    return torch.from_numpy(np.random.default_rng(seed).dirichlet([alpha] * VOCAB, size=rows)).float()


def _chi_square_pvalue(samples: list[int], probs: torch.Tensor) -> float:
    observed = np.bincount(samples, minlength=VOCAB)
    expected = probs.double().numpy() * len(samples)
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a zero-probability token was emitted"
    return float(chisquare(observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum()).pvalue)


@pytest.mark.parametrize("case", range(4))
def test_emitted_tokens_follow_the_target_distribution(case):
    """Drafts d_i ~ q_i; the first emitted token follows p_0 and, when the first draft was
    accepted, the second follows p_1 (the per-position target is fixed here), whatever q."""
    gen = torch.Generator().manual_seed(100 + case)
    k = 2
    alpha = (0.3, 1.0, 3.0, 0.5)[case]
    target = _dirichlet(case, k + 1, alpha)
    draft = _dirichlet(10 + case, k, alpha)
    if case == 3:  # q puts no mass where p has most: heavy rejection
        draft[:, target[:k].argmax(dim=-1)] = 0.0
        draft = draft / draft.sum(dim=-1, keepdim=True)
    first, second = [], []
    for _ in range(NUM_TRIALS):
        drafts = torch.multinomial(draft, 1, generator=gen).squeeze(1)
        tokens = rejection_sample(target, draft, drafts, gen)
        assert 1 <= len(tokens) <= k + 1
        assert tokens[:-1] == drafts[: len(tokens) - 1].tolist()
        first.append(tokens[0])
        if len(tokens) >= 2:
            second.append(tokens[1])
    assert _chi_square_pvalue(first, target[0]) > 1e-3
    assert len(second) > 500
    assert _chi_square_pvalue(second, target[1]) > 1e-3


def test_identical_draft_is_always_accepted():
    gen = torch.Generator().manual_seed(7)
    probs = _dirichlet(7, 4, 1.0)
    for _ in range(200):
        drafts = torch.multinomial(probs[:3], 1, generator=gen).squeeze(1)
        assert rejection_sample(probs, probs[:3], drafts, gen)[:3] == drafts.tolist()


def test_greedy_target_keeps_the_argmax():
    """A one-hot p (greedy) accepts a draft iff it is p's token and otherwise emits p's token."""
    gen = torch.Generator().manual_seed(3)
    target = torch.nn.functional.one_hot(torch.tensor([2, 4, 1]), VOCAB).float()
    draft = _dirichlet(3, 2, 1.0)
    assert rejection_sample(target, draft, torch.tensor([2, 4]), gen) == [2, 4, 1]
    assert rejection_sample(target, draft, torch.tensor([2, 0]), gen) == [2, 4]
    assert rejection_sample(target, draft, torch.tensor([5, 4]), gen) == [2]


def test_matching_rule():
    assert num_accepted_matching([5, 6, 7, 8], [5, 6, 7]) == 3
    assert num_accepted_matching([5, 6, 9, 8], [5, 6, 7]) == 2
    assert num_accepted_matching([4, 6, 7, 8], [5, 6, 7]) == 0
    assert num_accepted_matching([4], []) == 0


def test_matching_rule_follows_the_target_distribution():
    """Deterministic proposal d: sample t ~ p and keep d while t == d (the runner's rule for
    n-gram and greedy drafts): the emitted token follows p."""
    gen = torch.Generator().manual_seed(11)
    target = _dirichlet(11, 2, 1.0)
    proposal = [int(target[0].argmax())]
    first = []
    for _ in range(NUM_TRIALS):
        sampled = torch.multinomial(target, 1, generator=gen).squeeze(1).tolist()
        first.append(sampled[: num_accepted_matching(sampled, proposal) + 1][0])
    assert _chi_square_pvalue(first, target[0]) > 1e-3
