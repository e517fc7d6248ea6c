"""Structured outputs on an engine with speculative decoding: a constrained request runs
without drafts (its grammar masks one sampled position per step), so its output equals the
output without speculation, while unconstrained requests next to it still get drafts."""

from __future__ import annotations

from pagedllm import SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from tests.helpers import float32_llm
from tests.spec_decode.test_spec_greedy_equality import record_spec_stats

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def test_constrained_output_same_with_and_without_speculation(checkpoint_factory):
    path = checkpoint_factory("LlamaForCausalLM", seed=2, vocab_size=1056)
    constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(
        json=SCHEMA, disable_any_whitespace=True))
    prompts = ["hello", "the cat sat", "1 2 3 1 2 3 1 2 3"]
    plain = float32_llm(path, {})
    expected = [o.outputs[0].text for o in plain.generate(prompts, constrained, use_tqdm=False)]
    del plain

    spec = float32_llm(path, {"speculative_config": NGRAM})
    stats = record_spec_stats(spec)
    got = [o.outputs[0].text for o in spec.generate(prompts, constrained, use_tqdm=False)]
    assert got == expected
    assert stats.num_drafts == 0
    assert all(text.startswith('{') for text in got)

    # An unconstrained request with a repeating prompt is drafted for in the same engine.
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    repeat = {"prompt_token_ids": [5, 6, 7, 8] * 8}
    spec.generate([repeat, *prompts], [free] + [constrained] * len(prompts), use_tqdm=False)
    assert stats.num_drafts > 0
