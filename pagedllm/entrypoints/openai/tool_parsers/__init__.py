"""Tool-call parsers: model text -> ``content`` and ``tool_calls`` (vLLM's
``--tool-call-parser`` names).

- ``abstract_tool_parser``: the ``ToolParser`` contract (final and partial snapshots).
- ``registry``: ``ToolParserManager``, name -> parser class.
- ``json_calls``: scanning JSON call objects that may still be growing.
- ``hermes``, ``llama3_json``, ``mistral``, ``pythonic``: one module each.
- ``constrained_tool_parser``: the output of ``tool_choice`` "required" and named, which
  the engine constrains to JSON.

Importing the package registers every parser (no torch: ``pagedllm serve`` checks
``--tool-call-parser`` before the engine starts).
"""

from pagedllm.entrypoints.openai.tool_parsers import (  # noqa: F401  (registers the parsers)
    hermes_tool_parser,
    llama_tool_parser,
    mistral_tool_parser,
    pythonic_tool_parser,
)
from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedOutput, ParsedToolCall, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.constrained_tool_parser import NamedToolParser, RequiredToolParser
from pagedllm.entrypoints.openai.tool_parsers.registry import ToolParserManager

__all__ = [
    "NamedToolParser",
    "ParsedOutput",
    "ParsedToolCall",
    "RequiredToolParser",
    "ToolParser",
    "ToolParserManager",
]
