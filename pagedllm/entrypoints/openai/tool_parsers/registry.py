"""``ToolParserManager``: the tool-call parsers by ``--tool-call-parser`` name (vLLM's name
for its registry)."""

from __future__ import annotations

from pagedllm.name_registry import NameRegistry


class ToolParserManager(NameRegistry):
    """Name -> parser class. Parsers register themselves with ``register_module(name)``;
    ``get_tool_parser(name)`` (vLLM's name for ``lookup``) raises ``KeyError`` listing the
    known ones."""

    what = "tool call parser"
    get_tool_parser = NameRegistry.__dict__["lookup"]  # the classmethod itself, bound to this class
