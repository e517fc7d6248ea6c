"""Property tests: for hundreds of constraints generated at random (hypothesis), a
random-weight model's greedy and sampled outputs satisfy them.

JSON schemas (objects with required and optional properties, arrays, enums, consts,
anyOf, nested, integer / number bounds, string lengths and formats, and unbounded integers,
numbers and strings under the engine's default bounds, any whitespace) must give outputs
that ``jsonschema`` validates; regexes, outputs that ``re.fullmatch``; choices, one of the
choices. An output cut by ``max_tokens`` is not checked, but 95% must complete. Every
batch runs in one ``generate`` call on one engine (one step serves all requests), so the
file stays well under a minute.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams

NUM_SCHEMAS = 200
#: Enough for the largest schemas drawn (nested arrays of objects, with the whitespace the
#: default bound allows between tokens): 98% of the 400 outputs complete in 96 tokens, 94% in 64.
MAX_TOKENS = 96
NAMES = st.from_regex(r"[a-z][a-z_]{0,5}", fullmatch=True)
SHORT_TEXT = st.text(alphabet='ab "\\é\n', max_size=4)


def _bounded_integer(low: int, span: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": low + span}


def _string(low: int, extra: int) -> dict:
    return {"type": "string", "minLength": low, "maxLength": low + extra}


LEAVES = st.one_of(
    st.builds(_bounded_integer, st.integers(-100, 100), st.integers(0, 1000)),
    st.builds(lambda low: {"type": "number", "minimum": low, "maximum": low + 10, "multipleOf": 0.5},
              st.integers(-10, 10)),
    st.builds(_string, st.integers(0, 3), st.integers(0, 6)),
    # NOTE: not "time" / "date-time": their RFC 3339 leap second ":60" fails jsonschema's checker.
    st.sampled_from(["date", "uuid", "ipv4"]).map(lambda f: {"type": "string", "format": f}),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}]),
    st.lists(st.one_of(SHORT_TEXT, st.integers(-5, 5), st.booleans(), st.none()), min_size=1, max_size=4,
             unique_by=json.dumps).map(lambda values: {"enum": values}),
    st.one_of(SHORT_TEXT, st.integers(-5, 5)).map(lambda value: {"const": value}),
    st.sampled_from([{"type": "integer"}, {"type": "integer", "minimum": 0}, {"type": "number"}, {"type": "string"}]),
)


def _object(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    objects = st.dictionaries(NAMES, children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(lambda req: _object(props, req)))
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
    any_of = st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options})
    return st.one_of(objects, arrays, any_of)


SCHEMAS = st.recursive(LEAVES, _containers, max_leaves=8)

_ATOMS = st.sampled_from(["[a-c]", "[0-9]", "x", r"\.", "(ab|c)", "[A-Z]", "-", "é"])
REGEXES = st.lists(st.tuples(_ATOMS, st.sampled_from(["", "?", "{1,3}", "{2}", "+"])), min_size=1, max_size=5).map(
    lambda parts: "".join(atom + (quant if quant != "+" else "{1,4}") for atom, quant in parts))
CHOICES = st.lists(st.text(alphabet='ab "\\\'é0', min_size=1, max_size=6), min_size=1, max_size=5, unique=True)


def draw(strategy: st.SearchStrategy, count: int) -> list:
    """``count`` distinct examples of ``strategy`` (reproducible: hypothesis derandomized)."""
    found: dict[str, object] = {}

    @settings(max_examples=count * 3, database=None, derandomize=True, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example):
        if len(found) < count:
            found.setdefault(json.dumps(example, sort_keys=True), example)

    collect()
    assert len(found) == count, f"hypothesis drew only {len(found)} distinct examples"
    return list(found.values())


@pytest.fixture(scope="module")
def llm(checkpoint_factory):
    """The default bounds, and strings of at most 16 characters: a random model's strings
    are noise that rarely ends."""
    path = checkpoint_factory("Qwen2ForCausalLM", seed=5, tie_word_embeddings=True, vocab_size=1056)
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=32 << 20, max_num_seqs=512,
               structured_outputs_config={"max_string_length": 16})


def _generate(llm: LLM, constraints: list[StructuredOutputsParams]):
    """Greedy and sampled (seeded) outputs of each constraint, as (constraint, completion) pairs."""
    params = []
    for i, constraint in enumerate(constraints):
        params.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=constraint))
        params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, structured_outputs=constraint))
    prompts = [f"item {i // 2}:" for i in range(len(params))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(constraints[i // 2], o.outputs[0]) for i, o in enumerate(outputs)]


def _format_checker() -> jsonschema.FormatChecker:
    """jsonschema's checks, with "date" checked for its form only (RFC 3339 full-date): a
    grammar cannot know that June has 30 days; and "ipv4" as four dot-separated decimal
    octets 0-255 with leading zeros allowed: xgrammar's ipv4 grammar accepts "64.04.026.2",
    which Python's ``ipaddress`` (jsonschema's check) refuses."""
    checker = jsonschema.FormatChecker()
    checker.checks("date")(lambda value: not isinstance(value, str) or bool(
        re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", value)))
    checker.checks("ipv4")(lambda value: not isinstance(value, str) or (
        bool(re.fullmatch(r"\d{1,3}(\.\d{1,3}){3}", value)) and all(int(o) <= 255 for o in value.split("."))))
    return checker


def _check_most_complete(results) -> list:
    done = [(c, o) for c, o in results if o.finish_reason == "stop"]
    assert {o.finish_reason for _, o in results} <= {"stop", "length"}
    assert len(done) >= 0.95 * len(results), f"only {len(done)} of {len(results)} completed"
    return done


def test_json_schema_outputs_validate(llm):
    schemas = draw(SCHEMAS, NUM_SCHEMAS)
    kinds = set().union(*(_keywords(s) for s in schemas))
    assert {"properties", "required", "items", "enum", "const", "anyOf", "format"} <= kinds
    constraints = [StructuredOutputsParams(json=s) for s in schemas]
    checker = _format_checker()
    for constraint, out in _check_most_complete(_generate(llm, constraints)):
        try:
            jsonschema.validate(json.loads(out.text), constraint.json, format_checker=checker)
        except (ValueError, jsonschema.ValidationError) as exc:
            pytest.fail(f"schema {json.dumps(constraint.json)}\noutput {out.text!r}\n{exc}")


def test_regex_and_choice_outputs_match(llm):
    regexes = draw(REGEXES, 60)
    choices = draw(CHOICES, 60)
    constraints = ([StructuredOutputsParams(regex=r) for r in regexes]
                   + [StructuredOutputsParams(choice=c) for c in choices])
    results = _generate(llm, constraints)
    for constraint, out in _check_most_complete(results):
        if constraint.regex is not None:
            assert re.fullmatch(constraint.regex, out.text), (constraint.regex, out.text)
        else:
            assert out.text in constraint.choice, (constraint.choice, out.text)


def _keywords(schema) -> set[str]:
    if isinstance(schema, list):
        return set().union(*(_keywords(s) for s in schema)) if schema else set()
    if not isinstance(schema, dict):
        return set()
    found = set(schema)
    for key, value in schema.items():
        if key == "properties":
            found |= _keywords(list(value.values()))
        elif key not in ("enum", "const", "required"):
            found |= _keywords(value)
    return found
