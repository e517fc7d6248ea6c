"""``ToolParserManager``: the tool-call parsers by ``--tool-call-parser`` name (vLLM's name
for its registry)."""

from __future__ import annotations

from typing import Callable, TypeVar

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser

P = TypeVar("P", bound=type[ToolParser])


class ToolParserManager:
    """Name -> parser class. Parsers register themselves with ``register_module(name)``."""

    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(cls, name: str) -> Callable[[P], P]:
        def register(parser: P) -> P:
            cls.tool_parsers[name] = parser
            return parser

        return register

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls.tool_parsers)

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        """The parser class called ``name``.

        Raises:
            KeyError: no such parser; the message lists the known ones (vLLM's wording).
        """
        if name not in cls.tool_parsers:
            raise KeyError(f"invalid tool call parser: {name} (chose from {{ {','.join(cls.names())} }})")
        return cls.tool_parsers[name]
