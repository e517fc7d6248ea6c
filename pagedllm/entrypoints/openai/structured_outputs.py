"""The request fields that ask for structured outputs, mapped onto ``StructuredOutputsParams``.

- OpenAI's ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``
  (any JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
  (OpenAI API reference, "Structured Outputs"; the official SDK's
  ``chat.completions.parse(response_format=Model)`` sends the last).
- vLLM's ``structured_outputs`` object: ``StructuredOutputsParams``' fields.
- vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` /
  ``guided_whitespace_pattern`` (and ``guided_decoding_backend``, which the engine's
  ``--structured-outputs-config`` overrides), still sent by much client code: accepted, with
  one warning line per field in the log.

A request may ask in one of these ways only.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

#: The legacy fields -> the ``StructuredOutputsParams`` field each sets.
LEGACY_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
}
_warned: set[str] = set()


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema`` (OpenAI's shape)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


def structured_outputs_params(
    response_format: Optional[ResponseFormat],
    structured_outputs: Optional[dict[str, Any]],
    legacy: dict[str, Any],
) -> Optional[StructuredOutputsParams]:
    """The constraint a request asks for, or None.

    Args:
        response_format: the request's ``response_format``.
        structured_outputs: the request's ``structured_outputs`` object.
        legacy: the request's ``guided_*`` fields (name -> value; None: unset).

    Raises:
        ValueError: more than one way used, ``json_schema`` without its object, or what
            ``StructuredOutputsParams`` refuses (no constraint or several; bad ``choice``).
    """
    legacy_set = {name: value for name, value in legacy.items() if value is not None}
    ways = [name for name, used in (
        ("response_format", response_format is not None and response_format.type != "text"),
        ("structured_outputs", bool(structured_outputs)),
        ("guided_*", any(name in LEGACY_FIELDS for name in legacy_set)),
    ) if used]
    if len(ways) > 1:
        raise ValueError(f"structured outputs may be asked in one way only; this request uses {' and '.join(ways)}.")
    for name in sorted(legacy_set):
        _warn_legacy(name)
    if structured_outputs:
        try:
            return StructuredOutputsParams(**structured_outputs)
        except TypeError as exc:  # an unknown key
            raise ValueError(f"structured_outputs: {exc}") from None
    if response_format is not None and response_format.type != "text":
        return _from_response_format(response_format)
    fields = {LEGACY_FIELDS[name]: value for name, value in legacy_set.items() if name in LEGACY_FIELDS}
    if not fields or set(fields) == {"whitespace_pattern"}:
        return None
    return StructuredOutputsParams(**fields)


def _from_response_format(response_format: ResponseFormat) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    schema = response_format.json_schema
    if schema is None:
        raise ValueError('response_format of type "json_schema" needs a "json_schema" object.')
    if schema.json_schema is None:
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=schema.json_schema)


def _warn_legacy(name: str) -> None:
    """One warning line per legacy field and process."""
    if name in _warned:
        return
    _warned.add(name)
    if name == "guided_decoding_backend":
        logger.warning("guided_decoding_backend is ignored: the engine's --structured-outputs-config chooses the "
                       "backend.")
    else:
        logger.warning("%s is deprecated (as in vLLM); use structured_outputs: {\"%s\": ...} or response_format.",
                       name, LEGACY_FIELDS[name])
