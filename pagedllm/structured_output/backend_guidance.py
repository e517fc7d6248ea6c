"""The llguidance backend ("guidance"): JSON schema, regex, choice, Lark or GBNF grammar.

llguidance (Microsoft, github.com/guidance-ai/llguidance) computes a request's token mask
from a lazily built lexer and an Earley parser, with no ahead-of-time compilation: it
covers JSON-schema keywords and grammar forms xgrammar does not, which is why ``auto``
falls back to it (vLLM's choice).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from pagedllm.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar
from pagedllm.structured_output.json_bounds import bound_schema
from pagedllm.structured_output.spec import GrammarSpec


def build_grammar(spec: GrammarSpec) -> str:
    """llguidance's grammar text of ``spec`` (not yet checked: see ``validate``); a JSON
    schema gets the spec's default bounds (``bound_schema``; whitespace as a pattern of at
    most ``max_whitespace_cnt`` characters, unless the request gives its own).

    Raises:
        ValueError: a kind llguidance does not take.
    """
    if spec.kind == "json":
        schema = bound_schema(json.loads(spec.text), spec.max_number_digits, spec.max_string_length)
        if spec.disable_additional_properties:
            schema = _no_additional_properties(schema)
        options: dict[str, Any] = {"whitespace_flexible": spec.any_whitespace}
        if spec.whitespace_pattern is not None:
            options["whitespace_pattern"] = spec.whitespace_pattern
        elif spec.any_whitespace and spec.max_whitespace_cnt is not None:
            options["whitespace_pattern"] = f"[\\x20\\x0A\\x0D\\x09]{{0,{spec.max_whitespace_cnt}}}"
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if spec.kind in ("regex", "choice", "grammar"):
        return llguidance.grammar_from(spec.kind, spec.text)  # type: ignore[arg-type]
    raise ValueError(f"llguidance does not support structured outputs of kind {spec.kind!r}.")


def validate(spec: GrammarSpec, tokenizer: Any = None) -> str:
    """Check ``spec`` with llguidance (without a tokenizer: syntax and support only).

    Returns:
        the grammar text.

    Raises:
        ValueError: llguidance's message.
    """
    grammar = build_grammar(spec)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(error)
    return grammar


def _no_additional_properties(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` has
    it false (vLLM's ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [_no_additional_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: _no_additional_properties(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        result["additionalProperties"] = False
    return result


class GuidanceGrammar(StructuredOutputGrammar):
    """A request's ``llguidance.LLMatcher``.

    llguidance stops as soon as nothing but a stop token may follow (its mask then allows
    only those); the stop token the model then samples is accepted here, as xgrammar does.
    """

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if self.matcher.is_stopped():
            return all(token_id in self.stop_token_ids for token_id in token_ids)
        accepted = self.matcher.try_consume_tokens(token_ids)
        return accepted == len(token_ids)

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        return token_ids[: self.matcher.validate_tokens(token_ids)]

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def reset(self) -> None:
        self.matcher.reset()


class GuidanceBackend(StructuredOutputBackend):
    """See ``StructuredOutputBackend``; ``stop_token_ids`` are llguidance's EOS tokens."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids)
        self.stop_token_ids = frozenset(stop_token_ids)

    def compile(self, spec: GrammarSpec) -> str:
        return validate(spec, self.ll_tokenizer)

    def new_grammar(self, compiled: str) -> GuidanceGrammar:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return GuidanceGrammar(matcher, self.stop_token_ids)
