"""Greedy outputs with speculative decoding are token-identical to transformers' (and so to
pagedllm without speculation, tests/engine/test_greedy_equality.py), for n-gram,
draft-model, EAGLE and EAGLE-3 proposals, under every scheduling regime the core tests use, and with prefix
caching on (a second pass hits blocks written while verifying drafts) and off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.messages.engine_core import SpecDecodingStats
from tests.engine.test_greedy_equality import MAX_TOKENS, PROMPT_LENGTHS, SCENARIOS, scenario_params
from tests.helpers import check_block_accounting, float32_llm, hf_greedy, random_prompts

SPEC_SCENARIOS = {**SCENARIOS, "no_prefix_caching": {"enable_prefix_caching": False}}
_references: dict = {}


def spec_configs(draft_path, eagle_heads) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_model": {"model": str(draft_path), "num_speculative_tokens": 3},
        **{method: {"method": method, "model": str(path), "num_speculative_tokens": 3}
           for method, path in eagle_heads.items()},
    }


def record_spec_stats(llm: LLM) -> SpecDecodingStats:
    """Sum the scheduler's per-step speculative-decoding statistics from now on."""
    scheduler = llm.llm_engine.engine_core.scheduler
    total = SpecDecodingStats.new(scheduler.num_spec_tokens)
    make_stats = scheduler.make_stats

    def recording(spec_decoding_stats=None):
        if spec_decoding_stats is not None:
            total.num_drafts += spec_decoding_stats.num_drafts
            total.num_draft_tokens += spec_decoding_stats.num_draft_tokens
            total.num_accepted_tokens += spec_decoding_stats.num_accepted_tokens
            for i, n in enumerate(spec_decoding_stats.num_accepted_tokens_per_pos):
                total.num_accepted_tokens_per_pos[i] += n
        return make_stats(spec_decoding_stats)

    scheduler.make_stats = recording
    return total


@pytest.mark.parametrize("scenario", scenario_params(SPEC_SCENARIOS))
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3"])
def test_spec_decode_greedy_matches_transformers(method, scenario, tiny_llama, noisy_llama_draft, llama_eagle_heads,
                                                 tokenizer):
    """The n-gram proposer drafts on these random prompts but the random model never follows
    them (its acceptance is tested on the shipped model, test_ngram_on_a_repeating_text); the
    noisy draft model gets drafts both accepted and rejected; the random EAGLE heads' drafts
    are (almost) all rejected (their acceptance: tests/spec_decode/test_eagle.py)."""
    prompts = random_prompts(PROMPT_LENGTHS, len(tokenizer), seed=1)
    if "ref" not in _references:
        _references["ref"] = [hf_greedy(tiny_llama, p, MAX_TOKENS) for p in prompts]
    expected = _references["ref"]
    kwargs = {**SPEC_SCENARIOS[scenario], "speculative_config": spec_configs(noisy_llama_draft, llama_eagle_heads)[method]}
    llm = float32_llm(tiny_llama, kwargs)
    stats = record_spec_stats(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2 if scenario in ("defaults", "block_size_8") else 1):  # the second pass hits the prefix cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, output, ref in zip(prompts, outputs, expected):
            assert output.outputs[0].token_ids == ref, f"prompt of {len(prompt)} tokens diverged"
            assert output.outputs[0].finish_reason == "length"
        check_block_accounting(llm)
    assert stats.num_drafts > 0, stats
    if method == "draft_model":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    if scenario == "preemption":
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_draft_equal_to_target_accepts_everything(tiny_qwen2, tokenizer):
    """A draft model identical to the target proposes exactly the greedy tokens: acceptance 1.0,
    k + 1 tokens per verifying step."""
    prompts = random_prompts([5, 40, 90], len(tokenizer), seed=4)
    llm = float32_llm(tiny_qwen2, {"speculative_config": {"model": str(tiny_qwen2), "num_speculative_tokens": 4,
                                                          "enable_adaptive_k": False}})
    assert_every_draft_accepted(llm, tiny_qwen2, prompts)


def test_constructed_ceiling_pair_accepts_everything(tiny_qwen2, tokenizer, tmp_path):
    """benchmarks/make_spec_ceiling.py: a target whose layers after the first add nothing and a
    one-layer draft equal to that layer accept every draft (the benchmark's ceiling row)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "make_spec_ceiling.py"
    subprocess.run([sys.executable, str(script), "--target", str(tiny_qwen2), "--out-target", str(tmp_path / "target"),
                    "--out-draft", str(tmp_path / "draft")], check=True, capture_output=True)
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["num_hidden_layers"] == 1
    prompts = random_prompts([5, 40, 90], len(tokenizer), seed=4)
    llm = float32_llm(tmp_path / "target",
                      {"speculative_config": {"model": str(tmp_path / "draft"), "num_speculative_tokens": 4,
                                              "enable_adaptive_k": False}})
    assert_every_draft_accepted(llm, tmp_path / "target", prompts)


def assert_every_draft_accepted(llm: LLM, path, prompts: list[list[int]]) -> None:
    """21 greedy tokens per prompt equal transformers', made by 1 prefill step and 4 steps
    that each verify 4 drafts (a fixed k = 4: ``enable_adaptive_k`` off) and keep all of
    them plus one token."""
    stats = record_spec_stats(llm)
    params = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(path, prompt, 21)
    n = len(prompts)
    assert stats.num_drafts == n * 4
    assert stats.num_accepted_tokens == stats.num_draft_tokens == n * 4 * 4
    assert stats.num_accepted_tokens_per_pos == [n * 4] * 4
    check_block_accounting(llm)


REPEAT_PASSAGE = (
    "Return a new list containing all items from the iterable in ascending order. A custom key "
    "function can be supplied to customize the sort order, and the reverse flag can be set to "
    "request the result in descending order."
)


def test_ngram_on_a_repeating_text():
    """The shipped model on text that repeats: n-gram drafts are accepted, and the greedy
    output is the one without speculation."""
    prompt = REPEAT_PASSAGE + "\n\n" + REPEAT_PASSAGE[:60]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    plain = LLM(kv_cache_memory_bytes=16 << 20).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(kv_cache_memory_bytes=16 << 20, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    stats = record_spec_stats(llm)
    spec = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert stats.num_accepted_tokens > 0, stats
