"""Structured outputs through ``LLM.generate`` on a random-weight model whose logits are
wider than its tokenizer: every kind of constraint, every scheduling regime giving the same
output, n > 1, stop strings, logprobs, the backends, and bad constraints refused early."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pydantic
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from pagedllm.structured_output.backend_types import StructuredOutputGrammar
from pagedllm.structured_output.manager import StructuredOutputManager
from tests.helpers import check_block_accounting, kv_block_bytes

PROMPTS = ["hello", "the cat sat", "1 2 3", "x"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
}
EBNF = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9] | "(" expr ")"'
LARK_EXPR = lark.Lark('start: expr\nexpr: term ("+" term)*\nterm: /[0-9]/ | "(" expr ")"')


@pytest.fixture(scope="module")
def model_path(checkpoint_factory):
    return checkpoint_factory("LlamaForCausalLM", seed=2, vocab_size=1056)


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(str(model_path), dtype="float32", kv_cache_memory_bytes=16 << 20)


def _params(constraint: StructuredOutputsParams, **kwargs) -> list[SamplingParams]:
    """A greedy and a seeded sampled request per prompt."""
    kwargs.setdefault("max_tokens", 48)
    return [SamplingParams(temperature=0.0, structured_outputs=constraint, **kwargs),
            SamplingParams(temperature=1.0, seed=11, structured_outputs=constraint, **kwargs)]


def _run(llm, constraint, **kwargs):
    params = _params(constraint, **kwargs)
    prompts = [p for p in PROMPTS for _ in params]
    return [o.outputs[0] for o in llm.generate(prompts, params * len(PROMPTS), use_tqdm=False)]


def test_json_schema_outputs_validate(llm):
    outs = _run(llm, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    done = [o for o in outs if o.finish_reason == "stop"]
    assert len(done) >= len(outs) - 1
    for o in done:
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_regex_choice_and_grammar(llm):
    for o in _run(llm, StructuredOutputsParams(regex=r"[a-z]{2,5}-\d{1,3}")):
        assert re.fullmatch(r"[a-z]{2,5}-\d{1,3}", o.text) and o.finish_reason == "stop"
    for o in _run(llm, StructuredOutputsParams(choice=["yes", "no", 'say "hi"'])):
        assert o.text in ("yes", "no", 'say "hi"') and o.finish_reason == "stop"
    for o in _run(llm, StructuredOutputsParams(grammar=EBNF), max_tokens=24):
        if o.finish_reason == "stop":
            LARK_EXPR.parse(o.text)
        else:
            assert re.fullmatch(r"[0-9+()]*", o.text)


def test_pydantic_schema_and_guided_decoding_alias(llm):
    class Pet(pydantic.BaseModel):
        kind: str = pydantic.Field(max_length=5)
        legs: int = pydantic.Field(ge=0, le=8)

    params = SamplingParams(temperature=0.0, max_tokens=48,
                            guided_decoding=GuidedDecodingParams(json=Pet.model_json_schema(), disable_any_whitespace=True))
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    for o in out:
        assert o.outputs[0].finish_reason == "stop"
        Pet.model_validate_json(o.outputs[0].text)


class AllowAll(StructuredOutputGrammar):
    """A grammar that allows every token of the logits and never ends."""

    def accept_tokens(self, token_ids):
        return True

    def validate_tokens(self, token_ids):
        return token_ids

    def rollback(self, num_tokens):
        pass

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = -1

    def is_terminated(self):
        return False

    def reset(self):
        pass


def test_allow_everything_constraint_equals_unconstrained(llm, monkeypatch):
    # NOTE: no regex or grammar allows every token of a byte-level vocabulary (a lone
    # UTF-8 continuation byte is not text), so the grammar is replaced: the whole path
    # (bitmask in the scheduler output, laid out on the sampler's rows, applied before
    # temperature) runs with a mask that allows everything.
    monkeypatch.setattr(StructuredOutputManager, "_new_grammar", staticmethod(lambda compiled: AllowAll()))
    free = [SamplingParams(temperature=0.0, max_tokens=16), SamplingParams(temperature=1.0, seed=5, max_tokens=16),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=6, max_tokens=16)]
    constrained = [p.clone() for p in free]
    for p in constrained:
        p.structured_outputs = StructuredOutputsParams(regex="unused")
    prompts = [p for p in PROMPTS for _ in free]
    expected = llm.generate(prompts, free * len(PROMPTS), use_tqdm=False)
    got = llm.generate(prompts, constrained * len(PROMPTS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_constraint_does_not_touch_unconstrained_neighbours(llm):
    free = SamplingParams(temperature=0.0, max_tokens=16)
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    mixed = llm.generate(PROMPTS * 2, [free] * 4 + _params(StructuredOutputsParams(choice=["a", "b"]))[:1] * 4,
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    assert all(o.outputs[0].text in ("a", "b") for o in mixed[4:])


@pytest.mark.parametrize("regime", ["chunked_prefill", "preemption", "prefix_cache_hit"])
def test_scheduling_regimes_give_identical_output(llm, model_path, regime):
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    prompts = [p * 20 for p in PROMPTS]  # 60+ tokens: several chunks and blocks
    params = _params(constraint, max_tokens=40)
    args = ([p for p in prompts for _ in params], params * len(prompts))
    expected = [o.outputs[0].token_ids for o in llm.generate(*args, use_tqdm=False)]
    if regime == "chunked_prefill":
        other = LLM(str(model_path), dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=16)
    elif regime == "preemption":
        kwargs = dict(dtype="float32", max_model_len=256, block_size=16)
        other = LLM(str(model_path), kv_cache_memory_bytes=16 * kv_block_bytes(llm), **kwargs)
    else:
        other = llm
    got = [o.outputs[0].token_ids for o in other.generate(*args, use_tqdm=False)]
    assert got == expected
    if regime == "preemption":
        assert other.llm_engine.engine_core.scheduler.num_preemptions > 0
    check_block_accounting(other)


def test_n_sequences_each_follow_the_grammar(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=48,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    (out,) = llm.generate(["pets"], params, use_tqdm=False)
    texts = [c.text for c in out.outputs if c.finish_reason == "stop"]
    assert len(texts) >= 3 and len(set(texts)) > 1
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_stop_strings_and_logprobs(llm):
    constraint = StructuredOutputsParams(regex=r"(ab)+c")
    params = SamplingParams(temperature=0.0, max_tokens=32, stop=["bab"], logprobs=2, structured_outputs=constraint)
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    for o in out:
        completion = o.outputs[0]
        assert completion.finish_reason == "stop"
        assert re.fullmatch(r"(ab)+c|a", completion.text), completion.text
        assert len(completion.logprobs) == len(completion.token_ids)
        for token, entry in zip(completion.token_ids, completion.logprobs):
            assert token in entry and entry[token].logprob <= 0.0


def test_bad_constraint_is_refused_before_generation_and_the_engine_goes_on(llm):
    with pytest.raises(ValueError, match="Invalid structured outputs regex: .*parenthesis"):
        llm.generate(PROMPTS, [SamplingParams(max_tokens=4)] * 3
                     + [SamplingParams(structured_outputs=StructuredOutputsParams(regex="a("))], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(["x"], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["ok"])),
                       use_tqdm=False)
    assert out[0].outputs[0].text == "ok"


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_backend_choice(model_path, backend):
    llm = LLM(str(model_path), dtype="float32", kv_cache_memory_bytes=16 << 20,
              structured_outputs_config={"backend": backend, "disable_any_whitespace": True,
                                         "disable_additional_properties": True})
    outs = _run(llm, StructuredOutputsParams(json=SCHEMA))
    done = [o for o in outs if o.finish_reason == "stop"]
    assert len(done) >= len(outs) - 1
    for o in done:
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', o.text)
        # xgrammar's compact separators are ", " and ": ", llguidance's "," and ":".
        assert not re.search(r"\s", outside_strings.replace(", ", ",").replace(": ", ":")), o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    all_of = StructuredOutputsParams(json={"allOf": [{"type": "integer"}, {"minimum": 3}]})
    if backend == "xgrammar":
        with pytest.raises(ValueError, match="xgrammar does not support the JSON schema keywords allOf"):
            llm.generate(["x"], SamplingParams(structured_outputs=all_of), use_tqdm=False)
    else:
        for o in _run(llm, all_of, max_tokens=8):
            assert o.finish_reason == "length" or int(o.text) >= 3
