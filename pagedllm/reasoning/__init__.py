"""Reasoning parsers: model text -> ``reasoning`` and ``content`` (vLLM's
``--reasoning-parser`` names: ``deepseek_r1``, ``qwen3``, ``gpt_oss``).

- ``abs_reasoning_parsers``: the ``ReasoningParser`` contract (final and partial
  snapshots), ``ReasoningStream`` (streamed deltas) and ``ReasoningParserManager``.
- ``think_tags``: the ``<think>`` ... ``</think>`` rule of ``deepseek_r1`` and ``qwen3``.
- ``gptoss_reasoning_parser``: gpt-oss's harmony channels.

Importing the package registers every parser (plain Python: ``pagedllm serve`` checks
``--reasoning-parser`` before the engine starts).
"""

from pagedllm.reasoning import (  # noqa: F401  (registers the parsers)
    deepseek_r1_reasoning_parser,
    gptoss_reasoning_parser,
    qwen3_reasoning_parser,
)
from pagedllm.reasoning.abs_reasoning_parsers import (
    ParsedReasoning,
    ReasoningParser,
    ReasoningParserManager,
    ReasoningStream,
)

__all__ = ["ParsedReasoning", "ReasoningParser", "ReasoningParserManager", "ReasoningStream"]
