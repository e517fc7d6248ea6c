"""``--reasoning-parser qwen3``: Qwen3's thinking mode (``think_tags``' rule) with its switch
``chat_template_kwargs: {"enable_thinking": false}``. Source: vLLM's ``Qwen3ReasoningParser``.

With thinking off, Qwen3's template closes an empty block in the prompt
(``<think>\\n\\n</think>\\n\\n``) and the model answers at once: the whole output is content,
streamed or not (vLLM streams it so, as the prompt already ends the reasoning).
"""

from __future__ import annotations

from pagedllm.reasoning.abs_reasoning_parsers import ParsedReasoning, ReasoningParserManager
from pagedllm.reasoning.think_tags import ThinkTagReasoningParser


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """``think_tags``' rule unless the request turns thinking off (``enable_thinking`` false)."""

    @property
    def thinking_enabled(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking", True) is not False

    def is_reasoning_end(self, text: str) -> bool:
        return not self.thinking_enabled or super().is_reasoning_end(text)

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        if not self.thinking_enabled:
            return ParsedReasoning(content=text)
        return super().parse(text, final)
