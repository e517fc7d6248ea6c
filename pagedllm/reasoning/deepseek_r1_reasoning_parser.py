"""``--reasoning-parser deepseek_r1``: DeepSeek-R1 and its distillations. R1's chat template
ends the prompt with ``<think>\\n``, so the output often starts inside the block and holds
only ``</think>``: the text before it is reasoning (``think_tags``). Source: vLLM's
``DeepSeekR1ReasoningParser``."""

from __future__ import annotations

from pagedllm.reasoning.abs_reasoning_parsers import ReasoningParserManager
from pagedllm.reasoning.think_tags import ThinkTagReasoningParser


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """``think_tags``' rule, as it stands."""
