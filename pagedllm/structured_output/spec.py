"""``GrammarSpec``: one request's constraint in canonical, hashable form (the compile-cache key)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from pagedllm.config import StructuredOutputsConfig
from pagedllm.sampling_params import StructuredOutputsParams

#: The JSON schema of OpenAI's ``json_object`` mode and vLLM's ``json_object=True``: any object.
ANY_JSON_OBJECT = '{"type": "object"}'


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint as the backends compile it.

    Attributes:
        kind: "json", "regex", "choice", "grammar" or "structural_tag" (``json_object``
            becomes "json" with ``ANY_JSON_OBJECT``).
        text: the JSON schema (canonical JSON text, so a dict and its JSON text are one
            key), the regex, the choices as a JSON list, the grammar or the structural tag.
        any_whitespace: JSON may have whitespace between tokens (False:
            ``disable_any_whitespace``, the request's or the engine's).
        whitespace_pattern: a regex for that whitespace, or None (the backend's default).
        disable_additional_properties: objects without ``additionalProperties`` take none
            (the request's or the engine's option).
        max_whitespace_cnt, max_number_digits, max_string_length: the engine's default
            bounds on JSON (``StructuredOutputsConfig``; None: unbounded), which the
            backends apply (``json_bounds.bound_schema``).
    """

    kind: str
    text: str
    any_whitespace: bool = True
    whitespace_pattern: Optional[str] = None
    disable_additional_properties: bool = False
    max_whitespace_cnt: Optional[int] = None
    max_number_digits: Optional[int] = None
    max_string_length: Optional[int] = None


def grammar_spec(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> GrammarSpec:
    """The ``GrammarSpec`` of a request's constraint under the engine's options.

    Raises:
        ValueError: ``json`` is text that is not JSON, or neither a dict nor text; a
            ``structural_tag`` that is not JSON text.
    """
    kind = params.kind
    value = getattr(params, kind)
    if kind == "json":
        text = _canonical_json(value, "json")
    elif kind == "json_object":
        kind, text = "json", ANY_JSON_OBJECT
    elif kind == "choice":
        text = json.dumps(list(value), ensure_ascii=False)
    elif kind == "structural_tag":
        text = _canonical_json(value, "structural_tag")
    else:
        text = value
    return GrammarSpec(
        kind=kind,
        text=text,
        any_whitespace=not (params.disable_any_whitespace or config.disable_any_whitespace),
        whitespace_pattern=params.whitespace_pattern,
        disable_additional_properties=(params.disable_additional_properties
                                       or config.disable_additional_properties),
        max_whitespace_cnt=config.max_whitespace_cnt,
        max_number_digits=config.max_number_digits,
        max_string_length=config.max_string_length,
    )


def _canonical_json(value: object, field: str) -> str:
    """Canonical JSON text of a dict, or of JSON text (parsed, then written back).

    Raises:
        ValueError: text that is not JSON, or a value that is neither a dict nor text.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured outputs {field} is not valid JSON: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise ValueError(f"structured outputs {field} must be a JSON object, got {type(value).__name__}.")
    # NOTE: keys keep their order: a schema's property order is the output's.
    return json.dumps(value, ensure_ascii=False)
