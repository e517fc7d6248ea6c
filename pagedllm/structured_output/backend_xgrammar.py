"""The xgrammar backend (the default): JSON schema, regex, choice, EBNF grammar, structural tag.

xgrammar (Dong et al. 2024, arXiv:2411.15100) compiles a grammar against the tokenizer's
vocabulary once, then fills a request's next-token bitmask in microseconds. Its
``GrammarCompiler`` keeps its own cache too; ours (``StructuredOutputManager``) sits in
front of it.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any, Callable, Iterator

import numpy as np
import torch
import xgrammar as xgr

from pagedllm.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar
from pagedllm.structured_output.json_bounds import bound_schema, schema_nodes
from pagedllm.structured_output.spec import GrammarSpec

#: JSON-schema keywords xgrammar 0.2 accepts but does not enforce (checked one by one: a
#: violating instance is accepted), besides ``multipleOf`` on numbers and ``pattern`` with
#: a length (it warns and drops them): a schema using one is refused here (with ``auto``,
#: it goes to llguidance, which enforces or refuses it).
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
    grammar = xgr.Grammar
    return _make(spec, grammar.from_json_schema, grammar.from_regex, grammar.from_ebnf, grammar.from_structural_tag)


def _make(spec: GrammarSpec, json_schema: Callable, regex: Callable, ebnf: Callable, structural_tag: Callable) -> Any:
    """``spec`` built by the function of its kind (``xgr.Grammar``'s ``from_*`` or a
    ``GrammarCompiler``'s ``compile_*``).

    Raises:
        ValueError: see ``build_grammar``.
    """
    _check_supported(spec)
    with _xgrammar_errors():
        if spec.kind == "json":
            options = {"any_whitespace": spec.any_whitespace, "strict_mode": True,
                       "max_whitespace_cnt": spec.max_whitespace_cnt if spec.any_whitespace else None}
            schema = _xgrammar_schema(spec)
            if spec.max_string_length is None:
                return json_schema(schema, **options)
            return ebnf(bounded_strings(printed_ebnf(xgr.Grammar.from_json_schema(schema, **options)),
                                        spec.max_string_length))
        if spec.kind == "regex":
            return regex(spec.text)
        if spec.kind == "choice":
            return ebnf(choice_ebnf(json.loads(spec.text)))
        if spec.kind == "grammar":
            return ebnf(spec.text)
        return structural_tag(spec.text)


def _check_supported(spec: GrammarSpec) -> None:
    """Refuse what xgrammar would accept without enforcing it.

    Raises:
        ValueError: naming it.
    """
    if spec.kind not in ("json", "regex", "choice", "grammar", "structural_tag"):
        raise ValueError(f"xgrammar does not support structured outputs of kind {spec.kind!r}.")
    if spec.whitespace_pattern is not None:
        raise ValueError("xgrammar does not support whitespace_pattern.")
    if spec.kind == "json":
        unsupported = _unsupported_json_features(json.loads(spec.text))
        if unsupported:
            raise ValueError(f"xgrammar does not support the JSON schema keywords {', '.join(unsupported)}.")


@contextlib.contextmanager
def _xgrammar_errors() -> Iterator[None]:
    """xgrammar's errors as ``ValueError``s with its message (without its log prefix)."""
    try:
        yield
    except (RuntimeError, TypeError) as exc:
        raise ValueError(_LOG_PREFIX.sub("", str(exc)).strip()) from None


def _xgrammar_schema(spec: GrammarSpec) -> str:
    """The schema xgrammar compiles: ``spec``'s default bounds on numbers
    (``bound_schema``), and each length-limited string without a pattern or format gets the
    pattern of JSON's unescaped characters with those limits (a ``minLength`` alone: up to
    ``max_string_length``, when set).

    NOTE: xgrammar 0.2 lets control characters into length-limited strings, which makes
    the output invalid JSON (RFC 8259 section 7); its own strings of that kind have no
    escapes either.
    """
    schema = bound_schema(json.loads(spec.text), spec.max_number_digits, None)
    for node in schema_nodes(schema):
        limited = "minLength" in node or "maxLength" in node
        if node.get("type") == "string" and limited and "pattern" not in node and "format" not in node:
            low = node.pop("minLength", 0)
            default = "" if spec.max_string_length is None else max(low, spec.max_string_length)
            node["pattern"] = f"^{_JSON_STRING_CHAR}{{{low},{node.pop('maxLength', default)}}}$"
    return json.dumps(schema, ensure_ascii=False)


#: xgrammar 0.2's rule for the rest of a JSON string after its opening quote, of any
#: length (its shared ``basic_string``: the strings a schema leaves unbounded, and the
#: keys and strings of free-form values).
_UNBOUNDED_STRING = (r'basic_string_sub ::= (("\"") | ([^\0-\x1f\"\\\r\n] basic_string_sub) '
                     r'| ("\\" basic_escape basic_string_sub))')
#: The same rule as a regex of at most {n} characters (an escape counts as one, as for
#: ``maxLength``; RFC 8259 section 7), as an EBNF string literal.
_BOUNDED_STRING = r'basic_string_sub ::= Regex("([^\"\\\\\x00-\x1f]|\\\\[\"\\\\/bfnrt]|\\\\u[0-9a-fA-F]{{4}}){{0,{n}}}\"")'


def bounded_strings(ebnf: str, max_length: int) -> str:
    """``ebnf`` (an xgrammar JSON grammar) with its unbounded strings bounded to
    ``max_length`` characters.

    NOTE: a regex rather than xgrammar's repetition ``{0, n}``, whose mask costs grow with
    n (175 ms a token at 1000 on the shipped model's vocabulary); the regex's cost is
    about 0.02 ms a token up to n = 128 (0.5 s more to compile) and 3.5 ms beyond.

    Raises:
        ValueError: the grammar has a ``basic_string`` rule of another form (an xgrammar
            other than 0.2's).
    """
    if "basic_string ::=" not in ebnf:
        return ebnf
    if _UNBOUNDED_STRING not in ebnf:
        raise ValueError("xgrammar's JSON string rule is not the one pagedllm bounds (max_string_length).")
    return ebnf.replace(_UNBOUNDED_STRING, _BOUNDED_STRING.format(n=max_length))


def printed_ebnf(grammar: xgr.Grammar) -> str:
    """``grammar``'s EBNF text, which ``from_ebnf`` reads back as the same grammar.

    NOTE: xgrammar 0.2 prints a character U+0080 .. U+00FF of a literal as \\xNN, which
    its parser reads together with the hex letters that follow ("éab" became U+E9AB):
    such escapes are written back as the characters themselves.
    """
    return _LATIN1_ESCAPE.sub(lambda m: chr(int(m.group(2), 16)) if m.group(2) else m.group(0), str(grammar))


#: A backslash pair, or the escape \xNN of a character U+0080 .. U+00FF (group 2: its hex).
_LATIN1_ESCAPE = re.compile(r"\\(\\|x([89a-fA-F][0-9a-fA-F]))")


#: One character of a JSON string that needs no escape.
_JSON_STRING_CHAR = r'[^"\\\x00-\x1f]'


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (string literals escaped as JSON)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _unsupported_json_features(schema: Any) -> list[str]:
    """What a JSON schema asks that xgrammar would not enforce (empty: nothing)."""
    found: set[str] = set()
    for node in schema_nodes(schema):
        found.update(UNSUPPORTED_JSON_KEYWORDS.intersection(node))
        if "multipleOf" in node and node.get("type") != "integer":
            found.add("multipleOf (on non-integers)")
        if "pattern" in node and ("minLength" in node or "maxLength" in node):
            found.add("pattern with minLength / maxLength")
    return sorted(found)


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
        # NOTE: handed over as a torch tensor sharing ``bitmask``'s memory (xgrammar's
        # documented argument). Given the numpy array itself, on an H200 machine (numpy
        # 2.5, torch 2.11) the fill never reached the array: every token stayed allowed.
        self.matcher.fill_next_token_bitmask(torch.from_numpy(bitmask), row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()


class XgrammarBackend(StructuredOutputBackend):
    """See ``StructuredOutputBackend``; ``stop_token_ids`` are xgrammar's stop tokens."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        # NOTE: compiled from the text, not from ``build_grammar``'s ``Grammar``: xgrammar 0.2
        # prints a non-ASCII character of a literal as \xNN, which the compile then reads
        # together with the hex letters that follow ("éab" became U+E9AB).
        compiler = self.compiler
        return _make(spec, compiler.compile_json_schema, compiler.compile_regex, compiler.compile_grammar,
                     compiler.compile_structural_tag)

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        return XgrammarGrammar(xgr.GrammarMatcher(compiled))
