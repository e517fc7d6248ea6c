"""Verification of draft tokens: which of the k proposed tokens the target keeps.

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling"): at draft position i, with target distribution p_i and draft
distribution q_i, the draft token d_i is accepted with probability min(1, p_i(d_i) /
q_i(d_i)); the first rejected position instead draws from norm(max(0, p_i - q_i)); when all
k are accepted, a bonus token is drawn from p_{k+1}. Each emitted token then follows the
target distribution exactly.

Two forms:

* ``num_accepted_matching``: for deterministic proposals (n-gram lookup, a greedy draft
  model), q_i is a point mass on d_i: accepting with probability p_i(d_i) and otherwise
  drawing from p_i conditioned on "not d_i" is the same as drawing t_i ~ p_i (the target's
  ordinary sampler, with its seeds, penalties and logprobs) and accepting while t_i == d_i.
  Greedy requests are then token-identical to decoding without speculation, and seeded
  ones draw the same tokens, since each output position has its own seed.
* ``rejection_sample``: the general rule, for proposals drawn from a recorded q (a draft
  model's drafts for unseeded sampled requests).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def num_accepted_matching(target_token_ids: Sequence[int], draft_token_ids: Sequence[int]) -> int:
    """How many leading drafts equal the target's tokens at their positions.

    Args:
        target_token_ids: the k + 1 tokens the target sampled at the request's positions
            (after its last known token, then after each draft).
        draft_token_ids: the k drafts.

    Returns:
        m in 0 .. k; the request's new tokens are ``target_token_ids[: m + 1]``.
    """
    for i, draft in enumerate(draft_token_ids):
        if target_token_ids[i] != draft:
            return i
    return len(draft_token_ids)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    generator: Optional[torch.Generator] = None,
) -> list[int]:
    """The tokens one request keeps from a draft drawn from ``draft_probs``.

    Args:
        target_probs: [k + 1, V] float32, the target's distributions (after temperature,
            top-k / top-p, penalties) at the k draft positions and the bonus position.
        draft_probs: [k, V] float32, the distributions the drafts were drawn from (q).
        draft_token_ids: [k] int64, the drafts.
        generator: the source of the uniform draws and resamples (same device), or None
            for the default generator.

    Returns:
        1 .. k + 1 token ids: the accepted drafts, then the resampled (or bonus) token.
    """
    k = draft_token_ids.shape[0]
    positions = torch.arange(k, device=target_probs.device)
    p_draft = target_probs[positions, draft_token_ids]
    q_draft = draft_probs[positions, draft_token_ids]
    uniform = torch.rand(k, generator=generator, device=target_probs.device, dtype=target_probs.dtype)
    # u < p / q, written without the division (q > 0 for a token drawn from q).
    rejected = (uniform * q_draft >= p_draft).nonzero()
    num_accepted = int(rejected[0, 0]) if len(rejected) else k
    if num_accepted == k:
        last = target_probs[k]
    else:
        last = (target_probs[num_accepted] - draft_probs[num_accepted]).clamp_min_(0.0)
        if not bool(last.sum() > 0):  # p <= q everywhere only by rounding: fall back to p
            last = target_probs[num_accepted]
    token = torch.multinomial(last, 1, generator=generator)
    return draft_token_ids[:num_accepted].tolist() + [int(token)]
