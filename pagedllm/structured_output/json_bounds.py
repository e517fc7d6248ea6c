"""Default bounds on a JSON schema's unbounded numbers and strings (plain Python).

A grammar leaves ``{"type": "integer"}`` or ``{"type": "string"}`` unbounded, and a small
model may then write digits or characters until ``max_tokens``. ``bound_schema`` adds the
engine's bounds (``StructuredOutputsConfig.max_number_digits`` / ``max_string_length``)
where the schema has none, so every output of the bounded schema still validates against
the original one. Both backends enforce ``minimum`` / ``maximum`` and ``maxLength``.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator, Optional

#: Keywords whose value maps names to subschemas, and keywords whose value is data.
NAME_TO_SCHEMA = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
LITERALS = frozenset({"enum", "const", "default", "examples", "required", "title", "description"})


def bound_schema(schema: Any, max_number_digits: Optional[int], max_string_length: Optional[int]) -> Any:
    """A copy of ``schema`` with default bounds (None: that kind left as it is).

    - an integer or number schema without ``maximum`` / ``exclusiveMaximum`` gets
      ``maximum`` 10**max_number_digits - 1 (and likewise ``minimum`` its negative),
      unless its other bound lies beyond that;
    - a string schema without ``maxLength``, ``pattern``, ``format``, ``enum`` or
      ``const`` gets ``maxLength`` max_string_length (or its ``minLength`` if larger).

    A node whose ``type`` is a list counts as each of its types (these keywords apply
    only to instances of their type, JSON Schema 2020-12 section 6).
    """
    schema = copy.deepcopy(schema)
    for node in schema_nodes(schema):
        types = node.get("type")
        types = set(types) if isinstance(types, list) else {types}
        if "enum" in node or "const" in node:
            continue
        if max_number_digits is not None and types & {"integer", "number"}:
            _bound_number(node, 10**max_number_digits - 1)
        if max_string_length is not None and "string" in types and not {"maxLength", "pattern", "format"} & set(node):
            low = node.get("minLength", 0)
            node["maxLength"] = max(max_string_length, low if isinstance(low, int) else 0)
    return schema


def _bound_number(node: dict, limit: int) -> None:
    low = _number(node.get("minimum", node.get("exclusiveMinimum")))
    high = _number(node.get("maximum", node.get("exclusiveMaximum")))
    if "maximum" not in node and "exclusiveMaximum" not in node and (low is None or low < limit):
        node["maximum"] = limit
    if "minimum" not in node and "exclusiveMinimum" not in node and (high is None or high > -limit):
        node["minimum"] = -limit


def _number(value: Any) -> Optional[float]:
    """A bound's value (draft-4's boolean ``exclusiveMinimum`` is no value)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def schema_nodes(schema: Any) -> Iterator[dict]:
    """Every (sub)schema object of a JSON schema; property names and literal values, such
    as those of ``enum`` / ``const``, are not walked into."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            yield node
            for key, value in node.items():
                if key in NAME_TO_SCHEMA and isinstance(value, dict):
                    stack.extend(value.values())
                elif key not in LITERALS:
                    stack.append(value)
