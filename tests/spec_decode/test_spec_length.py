"""Adaptive speculation length (``enable_adaptive_k``, pagedllm.core.spec_length): the rule
on its own, and the engine with the lengths it sends (0 included) against transformers."""

from __future__ import annotations

import itertools

import pytest

from pagedllm import SamplingParams
from pagedllm.core.spec_length import SpeculationLength, best_length
from tests.helpers import check_block_accounting, float32_llm, hf_greedy, random_prompts
from tests.spec_decode.test_spec_greedy_equality import record_spec_stats


def test_best_length():
    assert best_length(0.0, 0.1, 4) == 0  # nothing accepted: drafting only costs
    assert best_length(1.0, 0.1, 4) == 4  # everything accepted: the cap
    assert best_length(0.5, 0.0, 8) == 8  # free drafts (n-gram): any acceptance pays
    # alpha 0.6, cost 0.1: E(k) / (1 + 0.1 k) = 1.45, 1.63, 1.67, 1.65 for k = 1 .. 4.
    assert best_length(0.6, 0.1, 4) == 3
    # The same as maximising E(k) / (1 + k cost), E(k) = sum of alpha^i for i <= k, directly.
    for alpha, cost, cap in itertools.product((0.0, 0.05, 0.3, 0.5, 0.8, 0.95, 1.0), (0.0, 0.02, 0.1, 0.4, 2.0),
                                              (1, 4, 8)):
        rates = [sum(alpha**i for i in range(k + 1)) / (1.0 + k * cost) for k in range(cap + 1)]
        assert best_length(alpha, cost, cap) == max(range(cap + 1), key=lambda k: (rates[k], -k))


def lengths(rule: SpeculationLength, accepted: bool, steps: int) -> list[int]:
    """The lengths ``rule`` gives one request over ``steps`` steps when each of its drafts
    is verified the next step, all accepted or none."""
    out = []
    for _ in range(steps):
        k = rule.num_tokens("r")
        out.append(k)
        if k:
            rule.observe("r", k, k if accepted else 0)
    return out


def test_a_never_accepted_draft_falls_to_zero_and_probes():
    """After a few rejected steps the request stops drafting; it then proposes one draft
    after 8 idle steps, then 16, 32, and every 64 at most."""
    rule = SpeculationLength(max_tokens=4, ema_alpha=0.3, prior_cost=0.1)
    ks = lengths(rule, accepted=False, steps=300)
    first_zero = ks.index(0)
    assert 0 < first_zero <= 12 and ks[0] >= 1
    probes = [i for i, k in enumerate(ks) if k and i > first_zero]
    assert all(ks[i] == 1 for i in probes)
    assert [b - a for a, b in zip(probes, probes[1:])][:4] == [16, 32, 64, 64]
    assert probes[0] - first_zero == 8 - 1
    assert rule.acceptance("r") < 0.05
    assert sum(ks) < 0.1 * len(ks)  # bounded cost: about 1 draft in 64 steps in the end


def test_an_always_accepted_draft_climbs_to_the_cap():
    rule = SpeculationLength(max_tokens=8, ema_alpha=0.3, prior_cost=0.1)
    ks = lengths(rule, accepted=True, steps=12)
    assert ks[0] < 8 and ks[-4:] == [8] * 4
    assert ks == sorted(ks)  # it only climbs


def test_a_probe_that_is_accepted_resumes_drafting():
    rule = SpeculationLength(max_tokens=4, ema_alpha=0.3, prior_cost=0.1)
    ks = lengths(rule, accepted=False, steps=40)
    assert ks[-20:].count(0) >= 18
    assert max(lengths(rule, accepted=True, steps=40)[-5:]) >= 3


def test_step_costs_are_fitted():
    """Steps of 10 ms per request plus 1 ms per draft token (proposed + verified): a draft
    token, proposed and verified once each, costs 2 ms = 0.2 of a plain step's share."""
    rule = SpeculationLength(max_tokens=4, ema_alpha=0.3, prior_cost=0.05)
    assert rule.draft_token_cost == 0.05  # nothing measured: the prior
    for _ in range(5):
        rule.observe_step(0.080, 8, 0)
    assert rule.draft_token_cost == 0.05  # no spread in draft tokens yet
    for drafts, requests in itertools.product((0, 4, 8, 16), (1, 4)):
        rule.observe_step((0.010 * requests + 0.001 * drafts), requests, drafts)
    assert rule.draft_token_cost == pytest.approx(0.2)
    assert best_length(0.15, rule.draft_token_cost, 4) == 0
    assert best_length(0.9, rule.draft_token_cost, 4) == 4



def test_a_stalled_step_does_not_tilt_the_fit():
    """Steps of 2 ms per request plus 0.05 ms per draft token (cost 0.05); one step with 8
    draft tokens stalled 10x (another process, a busy host) enters the fit at 2x, so the
    cost stays below 0.1 and a request accepting 30% keeps drafting (counted in full, the
    stall made the cost 0.49: no drafting)."""
    rule = SpeculationLength(max_tokens=4, ema_alpha=0.3, prior_cost=0.05)
    for _ in range(10):
        for drafts in (0, 8, 4):
            rule.observe_step(0.002 + 0.00005 * drafts, 1, drafts)
    assert rule.draft_token_cost == pytest.approx(0.05)
    rule.observe_step(10 * 0.0024, 1, 8)
    assert rule.draft_token_cost < 0.1
    assert best_length(0.3, rule.draft_token_cost, 4) >= 1
    for _ in range(40):  # a lasting slow-down of the drafting steps is still learned
        for drafts in (0, 8):
            rule.observe_step(0.002 + 0.0005 * drafts, 1, drafts)
    assert rule.draft_token_cost == pytest.approx(0.5, rel=0.1)

def test_engine_with_varying_lengths_matches_transformers(tiny_llama, noisy_llama_draft, llama_eagle_heads, tokenizer):
    """The scheduler's lengths, here a fixed pattern with 0s (no drafts: the draft model
    skips those steps and catches up later), k < max and k = max, vary per request and
    step: the greedy output is transformers', the drafts counted are those proposed, and
    the prefix cache stays consistent (a second pass hits it)."""
    prompts = random_prompts([3, 17, 40, 70], len(tokenizer), seed=5)
    expected = [hf_greedy(tiny_llama, p, 24) for p in prompts]
    pattern = [0, 0, 3, 1, 0, 0, 0, 2, 3, 0, 1]
    for config in ({"model": str(noisy_llama_draft)}, {"method": "eagle", "model": str(llama_eagle_heads["eagle"])},
                   {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2}):
        llm = float32_llm(tiny_llama, {"speculative_config": {**config, "num_speculative_tokens": 3},
                                       "max_num_batched_tokens": 32})
        scheduler = llm.llm_engine.engine_core.scheduler
        counter = itertools.count()
        chosen: list[int] = []

        def num_tokens(req_id: str) -> int:
            chosen.append(pattern[next(counter) % len(pattern)])
            return chosen[-1]

        scheduler.spec_length.num_tokens = num_tokens
        stats = record_spec_stats(llm)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        for _ in range(1 if "method" in config else 2):  # the draft model's second pass hits the prefix cache
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == expected, config
            check_block_accounting(llm)
        assert 0 < stats.num_draft_tokens <= sum(chosen)
        assert stats.num_accepted_tokens <= stats.num_draft_tokens
        if "method" not in config:  # a draft model always proposes what it is asked for
            assert stats.num_drafts > 0 and max(stats.num_accepted_tokens_per_pos) <= stats.num_drafts


def test_engine_stops_drafting_for_a_head_that_is_never_accepted(tiny_llama, llama_eagle_heads, tokenizer):
    """A random EAGLE head (its drafts are almost never accepted) under the default adaptive
    length: two requests of 60 tokens, one after the other, verify a small fraction of the
    3 x 59 drafts per request a fixed k = 3 would, the second (starting from the first's
    acceptance) only its probes."""
    llm = float32_llm(tiny_llama, {"speculative_config": {"method": "eagle", "model": str(llama_eagle_heads["eagle"]),
                                                          "num_speculative_tokens": 3}})
    stats = record_spec_stats(llm)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for prompt in random_prompts([20, 30], len(tokenizer), seed=6):
        before = stats.num_draft_tokens
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert stats.num_draft_tokens < 0.25 * 2 * 3 * 59, stats
    assert 2 <= stats.num_draft_tokens - before <= 6  # probes at its steps 8, 24 and 56
