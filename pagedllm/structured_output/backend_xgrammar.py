"""The xgrammar backend (the default): JSON schema, regex, choice, EBNF grammar, structural tag.

xgrammar (Dong et al. 2024, arXiv:2411.15100) compiles a grammar against the tokenizer's
vocabulary once, then fills a request's next-token bitmask in microseconds. Its
``GrammarCompiler`` keeps its own cache too; ours (``StructuredOutputManager``) sits in
front of it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import xgrammar as xgr

from pagedllm.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar
from pagedllm.structured_output.spec import GrammarSpec

#: JSON-schema keywords xgrammar 0.2 accepts but does not enforce (checked one by one: a
#: violating instance is accepted): a schema using one is refused here (with ``auto``, it
#: goes to llguidance, which enforces or refuses it).
UNSUPPORTED_JSON_KEYWORDS = frozenset({
    "allOf", "not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
    "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedItems",
})

#: xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def build_grammar(spec: GrammarSpec) -> xgr.Grammar:
    """The tokenizer-free grammar of ``spec`` (parsing only: fast; used to validate).

    Raises:
        ValueError: xgrammar cannot parse or does not support the constraint (its message).
    """
    if spec.whitespace_pattern is not None:
        raise ValueError("xgrammar does not support whitespace_pattern.")
    if spec.kind == "json":
        unsupported = sorted(_json_keywords(json.loads(spec.text)) & UNSUPPORTED_JSON_KEYWORDS)
        if unsupported:
            raise ValueError(f"xgrammar does not support the JSON schema keywords {', '.join(unsupported)}.")
    try:
        if spec.kind == "json":
            return _json_schema_grammar(spec)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec.text)))
        if spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.text)
        if spec.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec.text)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(_LOG_PREFIX.sub("", str(exc)).strip()) from None
    raise ValueError(f"xgrammar does not support structured outputs of kind {spec.kind!r}.")


#: The character class xgrammar 0.2 gives the characters of a string with minLength /
#: maxLength (it lets control characters through, which JSON forbids), and the one of its
#: other strings.
_LENGTH_LIMITED_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\"\\\0-\x1f]'


def _json_schema_grammar(spec: GrammarSpec) -> xgr.Grammar:
    """xgrammar's grammar of a JSON schema, strict (no properties or items beyond the
    schema's), with JSON's own string characters in length-limited strings.

    Raises:
        ValueError: a string with both ``pattern`` and a length limit (xgrammar drops the
            limit).
    """
    if '"pattern"' in spec.text and _has_pattern_and_length(json.loads(spec.text)):
        raise ValueError("xgrammar does not support pattern together with minLength / maxLength.")
    grammar = xgr.Grammar.from_json_schema(spec.text, any_whitespace=spec.any_whitespace, strict_mode=True)
    text = str(grammar)
    if _LENGTH_LIMITED_CHAR not in text:
        return grammar
    # NOTE: a raw control character inside a string makes the output invalid JSON
    # (RFC 8259 section 7): the printed grammar is parsed again with the class fixed.
    return xgr.Grammar.from_ebnf(text.replace(_LENGTH_LIMITED_CHAR, _JSON_STRING_CHAR))


def _has_pattern_and_length(schema: Any) -> bool:
    if isinstance(schema, list):
        return any(_has_pattern_and_length(item) for item in schema)
    if not isinstance(schema, dict):
        return False
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        return True
    return any(_has_pattern_and_length(value) for value in schema.values())


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (string literals escaped as JSON)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _json_keywords(schema: Any) -> set[str]:
    """The keywords used anywhere in a JSON schema (property names and literal values,
    such as those of ``enum`` / ``const``, are not keywords)."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            found.update(node)
            for key, value in node.items():
                if key in _NAME_TO_SCHEMA and isinstance(value, dict):
                    stack.extend(value.values())
                elif key not in _LITERALS:
                    stack.append(value)
    return found


#: Keywords whose value maps names to subschemas, and keywords whose value is data.
_NAME_TO_SCHEMA = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_LITERALS = frozenset({"enum", "const", "default", "examples", "required", "title", "description"})


class XgrammarGrammar(StructuredOutputGrammar):
    """A request's ``xgr.GrammarMatcher``."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for i, token_id in enumerate(token_ids):
            if not self.matcher.accept_token(token_id):
                if i:
                    self.matcher.rollback(i)
                return False
        return True

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        accepted = 0
        for token_id in token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return token_ids[:accepted]

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()


class XgrammarBackend(StructuredOutputBackend):
    """See ``StructuredOutputBackend``; ``stop_token_ids`` are xgrammar's stop tokens."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        grammar = build_grammar(spec)
        try:
            return self.compiler.compile_grammar(grammar)
        except RuntimeError as exc:
            raise ValueError(_LOG_PREFIX.sub("", str(exc)).strip()) from None

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        return XgrammarGrammar(xgr.GrammarMatcher(compiled))
