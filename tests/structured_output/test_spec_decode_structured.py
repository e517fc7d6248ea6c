"""Structured outputs with speculative decoding: a constrained request's drafts are cut at the
first token its grammar refuses, and the target samples each verified position (the next
token, and the one after each draft) under the grammar state that the drafts before it lead
to (vLLM's ``validate_tokens`` / per-position bitmask / ``rollback``). Its greedy output is
then the output without speculation, and valid for its schema."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs, StructuredOutputsConfig
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.manager import StructuredOutputManager
from tests.helpers import check_block_accounting, float32_llm
from tests.spec_decode.test_spec_greedy_equality import record_spec_stats

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"],
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
# Prompts that contain the output's fixed parts, so prompt lookup proposes them.
PROMPTS = ['{"name": "ab", "age": 1, "ok": true} {"name": "cd", "age": 22, "ok": false}', "hello",
           '"name": "age": {"name": "ok": false']


@pytest.mark.parametrize("max_num_batched_tokens", [None, 16])
def test_constrained_greedy_output_same_with_and_without_speculation(max_num_batched_tokens, checkpoint_factory):
    path = checkpoint_factory("LlamaForCausalLM", seed=2, vocab_size=1056)
    constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(
        json=SCHEMA, disable_any_whitespace=True))
    kwargs = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    plain = float32_llm(path, kwargs)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, constrained, use_tqdm=False)]
    del plain

    spec = float32_llm(path, {**kwargs, "speculative_config": NGRAM})
    stats = record_spec_stats(spec)
    outputs = [o.outputs[0] for o in spec.generate(PROMPTS, constrained, use_tqdm=False)]
    assert [o.token_ids for o in outputs] == expected
    for output in outputs:
        jsonschema.validate(json.loads(output.text), SCHEMA)
    # Drafts of the constrained requests were verified, and the grammar-forced ones accepted.
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens, stats
    check_block_accounting(spec)


def test_bitmask_rows_follow_the_drafts_and_the_grammar_is_rolled_back(tiny_llama, tokenizer):
    config = EngineArgs(model=str(tiny_llama)).create_engine_config()
    manager = StructuredOutputManager(StructuredOutputsConfig(backend="xgrammar"), config.model_config)
    grammar, other = (manager.make_request(StructuredOutputsParams(regex=r"ab[0-9]+z")).future.result()
                      for _ in range(2))
    tokens = tokenizer.encode("ab12z", add_special_tokens=False)
    assert grammar.validate_tokens(tokens[:-1] + tokenizer.encode("q", add_special_tokens=False)) == tokens[:-1]

    drafts = tokens[:-1]
    bitmask = manager.grammar_bitmask([grammar], [drafts])
    assert bitmask.shape[0] == 1 + len(drafts)
    for position in range(len(drafts) + 1):
        want = manager.grammar_bitmask([other])
        np.testing.assert_array_equal(bitmask[position], want[0], err_msg=f"position {position}")
        if position < len(drafts):
            assert other.accept_tokens([drafts[position]])
    # Rolled back: the grammar is where it was, and accepts the whole text.
    np.testing.assert_array_equal(manager.grammar_bitmask([grammar])[0], bitmask[0])
    assert grammar.accept_tokens(tokens)
    manager.shutdown()
