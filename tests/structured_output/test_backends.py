"""The two backends on the tiny tokenizer: bitmasks, accept / validate / rollback /
termination, the vocabulary wider than the tokenizer, and backend choice ("auto")."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedllm.config import StructuredOutputsConfig
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend_guidance import GuidanceBackend
from pagedllm.structured_output.backend_xgrammar import XgrammarBackend, choice_ebnf
from pagedllm.structured_output.selection import check_structured_outputs, choose_backend
from pagedllm.structured_output.spec import grammar_spec

VOCAB = 1056  # the model's logits width: 32 ids past the tokenizer's 1024
BACKENDS = {"xgrammar": XgrammarBackend, "guidance": GuidanceBackend}


@pytest.fixture(scope="module", params=list(BACKENDS))
def backend(request, tokenizer):
    return BACKENDS[request.param](tokenizer, VOCAB, [tokenizer.eos_token_id])


def _grammar(backend, **constraint):
    spec = grammar_spec(StructuredOutputsParams(**constraint), StructuredOutputsConfig())
    return backend.new_grammar(backend.compile(spec))


def _allowed(grammar) -> set[int]:
    bitmask = np.zeros((2, -(-VOCAB // 32)), dtype=np.int32)
    grammar.fill_bitmask(bitmask, 1)
    assert not bitmask[0].any(), "fill_bitmask wrote outside its row"
    bits = (bitmask[1][:, None] >> np.arange(32)) & 1
    return set(np.flatnonzero(bits.reshape(-1)[:VOCAB]).tolist())


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_choice_walks_to_termination(backend, tokenizer):
    grammar = _grammar(backend, choice=["yes", "no"])
    first = _allowed(grammar)
    assert first and all(tokenizer.decode([t]) and ("yes".startswith(tokenizer.decode([t]))
                                                  or "no".startswith(tokenizer.decode([t]))) for t in first)
    assert not first & set(range(1024, VOCAB)), "ids past the tokenizer are never allowed"
    assert tokenizer.eos_token_id not in first
    assert grammar.accept_tokens(_encode(tokenizer, "yes"))
    assert _allowed(grammar) == {tokenizer.eos_token_id}, "only EOS where the grammar ends"
    # xgrammar ends on accepting EOS; llguidance as soon as nothing but EOS may follow.
    if not grammar.is_terminated():
        assert grammar.accept_tokens([tokenizer.eos_token_id])
    assert grammar.is_terminated()


def test_validate_and_rollback_leave_the_state_right(backend, tokenizer):
    grammar = _grammar(backend, regex=r"ab[0-9]+z")
    tokens = _encode(tokenizer, "ab12z")
    start = _allowed(grammar)
    assert grammar.validate_tokens(tokens + _encode(tokenizer, "q")) == tokens
    assert _allowed(grammar) == start, "validate_tokens does not advance"
    assert grammar.accept_tokens(tokens)
    grammar.rollback(len(tokens))
    assert _allowed(grammar) == start
    assert not grammar.accept_tokens(_encode(tokenizer, "x"))
    assert _allowed(grammar) == start, "a rejected token changes nothing"
    grammar.accept_tokens(tokens)
    grammar.reset()
    assert _allowed(grammar) == start


def test_json_schema_masks_keys_and_types(backend, tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = _grammar(backend, json=schema, disable_any_whitespace=True)
    assert grammar.accept_tokens(_encode(tokenizer, '{"n":'))
    allowed_text = {tokenizer.decode([t]) for t in _allowed(grammar)}
    # xgrammar's compact form is '{"n": 1}' (a space after the colon), llguidance's '{"n":1}'.
    assert allowed_text and all(text.strip()[:1] in "-0123456789" for text in allowed_text)
    assert any(text.strip() for text in allowed_text)


def test_choice_ebnf_escapes_quotes_and_backslashes():
    assert choice_ebnf(['say "hi"', "a\\b"]) == 'root ::= "say \\"hi\\"" | "a\\\\b"'


@pytest.mark.parametrize("constraint, message", [
    ({"regex": "a("}, "Invalid structured outputs regex: .*parenthesis is not closed"),
    ({"json": {"type": "nope"}}, "Invalid structured outputs json: .*nope"),
    ({"json": "{not json"}, "structured outputs json is not valid JSON"),
    ({"grammar": 'root ::= "a" missing'}, "Invalid structured outputs grammar: .*missing"),
])
def test_bad_constraints_name_the_problem(constraint, message):
    with pytest.raises(ValueError, match=message):
        check_structured_outputs(StructuredOutputsParams(**constraint), StructuredOutputsConfig())


def test_auto_falls_back_to_guidance_for_what_xgrammar_does_not_enforce():
    all_of = StructuredOutputsParams(json={"allOf": [{"type": "integer"}, {"minimum": 3}]})
    assert check_structured_outputs(all_of, StructuredOutputsConfig()) == "guidance"
    with pytest.raises(ValueError, match="xgrammar does not support the JSON schema keywords allOf"):
        check_structured_outputs(all_of, StructuredOutputsConfig(backend="xgrammar"))
    with pytest.raises(ValueError, match="allOf"):
        check_structured_outputs(all_of, StructuredOutputsConfig(disable_fallback=True))
    unique = StructuredOutputsParams(json={"type": "array", "uniqueItems": True})
    with pytest.raises(ValueError, match=r"uniqueItems. \(llguidance: Unimplemented keys: \[\"uniqueItems\"\]\)"):
        check_structured_outputs(unique, StructuredOutputsConfig())
    lark = StructuredOutputsParams(grammar='start: "a" /[0-9]+/')
    assert check_structured_outputs(lark, StructuredOutputsConfig()) == "guidance"
    whitespace = StructuredOutputsParams(json_object=True, whitespace_pattern=r"[ ]?")
    assert check_structured_outputs(whitespace, StructuredOutputsConfig()) == "guidance"
    plain = StructuredOutputsParams(json={"type": "object", "properties": {"format": {"type": "string"}}})
    assert check_structured_outputs(plain, StructuredOutputsConfig()) == "xgrammar", "a property named like a keyword"


def test_equal_schemas_are_one_cache_key():
    config = StructuredOutputsConfig()
    a = grammar_spec(StructuredOutputsParams(json={"type": "object", "required": ["x"]}), config)
    b = grammar_spec(StructuredOutputsParams(json=json.dumps({"type": "object", "required": ["x"]}, indent=2)), config)
    assert a == b and hash(a) == hash(b)
    assert choose_backend(a, "auto", False) == "xgrammar"


def test_config_rejects_unknown_backend_and_keys():
    with pytest.raises(ValueError, match="must be one of auto, xgrammar, guidance, got 'outlines'"):
        StructuredOutputsConfig.from_dict({"backend": "outlines"})
    with pytest.raises(ValueError, match="unknown keys \\['bakend'\\]"):
        StructuredOutputsConfig.from_dict({"bakend": "auto"})


def test_config_rejects_bounds_below_one():
    with pytest.raises(ValueError, match="max_whitespace_cnt must be a positive integer or null, got 0"):
        StructuredOutputsConfig.from_dict({"max_whitespace_cnt": 0})
    assert StructuredOutputsConfig.from_dict({"max_number_digits": None}).max_number_digits is None


UNBOUNDED = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}, "s": {"type": "string"}},
             "required": ["n", "x", "s"]}


def _completes(backend, tokenizer, text: str, schema=UNBOUNDED, **config) -> bool:
    """Whether ``text`` is a whole output of ``schema`` under ``config``."""
    spec = grammar_spec(StructuredOutputsParams(json=schema), StructuredOutputsConfig(**config))
    grammar = backend.new_grammar(backend.compile(spec))
    return grammar.accept_tokens(_encode(tokenizer, text)) and tokenizer.eos_token_id in _allowed(grammar)


def test_json_whitespace_and_numbers_are_bounded_by_default(backend, tokenizer):
    assert StructuredOutputsConfig().max_whitespace_cnt == 2 and StructuredOutputsConfig().max_number_digits == 15
    assert _completes(backend, tokenizer, '{\n "n": -999999999999999, "x": 0.5, "s": "a\\"b"}')
    for text in ('{"n": 1000000000000000, "x": 0.5, "s": ""}', '{"n": 1, "x": 1e300, "s": ""}',
                 '{\n\n\n"n": 1, "x": 0.5, "s": ""}'):
        assert not _completes(backend, tokenizer, text), text
        assert _completes(backend, tokenizer, text, max_number_digits=None, max_whitespace_cnt=None), text
    # a bound of the schema's own stays
    assert _completes(backend, tokenizer, "12345678901234567", {"type": "integer", "minimum": 10**16})


def test_max_string_length_bounds_strings_and_keeps_escapes(backend, tokenizer):
    assert StructuredOutputsConfig().max_string_length == 1024
    assert _completes(backend, tokenizer, '{"n": 1, "x": 1, "s": "a\\"\\nb"}', max_string_length=4)
    assert not _completes(backend, tokenizer, '{"n": 1, "x": 1, "s": "abcde"}', max_string_length=4)
    keys = {"type": "object", "properties": {"éab": {"const": "é"}, "m": {"type": "string", "minLength": 6}},
            "required": ["éab", "m"], "additionalProperties": False}
    assert _completes(backend, tokenizer, '{"éab": "é", "m": "abcdef"}', keys, max_string_length=4)
    assert not _completes(backend, tokenizer, '{"éab": "é", "m": "abcdefg"}', keys, max_string_length=4)


@pytest.mark.parametrize("constraint, text", [
    ({"choice": ['""\\éab', "é", "😀x"]}, '""\\éab'),
    ({"json": {"enum": ["éab", 1]}}, '"éab"'),
    ({"json": {"type": "object", "properties": {"éab": {"type": "string", "maxLength": 2}}, "required": ["éab"]},
      "disable_any_whitespace": True}, '{"éab": "xy"}'),
])
def test_non_ascii_literals_are_kept(backend, tokenizer, constraint, text):
    grammar = _grammar(backend, **constraint)
    compact = text.replace(": ", ":") if isinstance(backend, GuidanceBackend) else text
    assert grammar.accept_tokens(_encode(tokenizer, compact))
    if not grammar.is_terminated():
        assert grammar.accept_tokens([tokenizer.eos_token_id])


def test_length_limited_strings_refuse_control_characters(backend, tokenizer):
    grammar = _grammar(backend, json={"type": "string", "maxLength": 4})
    assert grammar.accept_tokens(_encode(tokenizer, '"a'))
    assert not grammar.accept_tokens(_encode(tokenizer, "\x17"))
    assert grammar.accept_tokens(_encode(tokenizer, 'b"'))


def test_structural_tag_with_xgrammar(tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f>"], "tags": [
        {"begin": "<f>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</f>"}]}}
    params = StructuredOutputsParams(structural_tag=json.dumps(tag))
    assert check_structured_outputs(params, StructuredOutputsConfig()) == "xgrammar"
    backend = XgrammarBackend(tokenizer, VOCAB, [tokenizer.eos_token_id])
    grammar = _grammar(backend, structural_tag=json.dumps(tag))
    assert grammar.accept_tokens(_encode(tokenizer, 'free text <f>{"a": 1}</f>'))
    assert not grammar.accept_tokens(_encode(tokenizer, '<f>{"b"'))
    with pytest.raises(ValueError, match="llguidance does not support structured outputs of kind 'structural_tag'"):
        check_structured_outputs(params, StructuredOutputsConfig(backend="guidance"))
