"""Reasoning written between ``<think>`` and ``</think>`` (DeepSeek-R1, Qwen3): the rule
both parsers share (vLLM's ``BaseThinkingReasoningParser``).

The text before the first ``</think>`` is reasoning, the text after it content; a
``<think>`` before it is dropped (the model may write it, or the chat template may have put
it in the prompt already: R1's and newer Qwen3 templates do). Output that never closes the
block (cut off by ``max_tokens``) is all reasoning.

NOTE: vLLM's non-streamed parser also drops any text before a ``<think>`` the model writes
late; here that text stays in the reasoning, so the streamed and non-streamed answers agree.
"""

from __future__ import annotations

from pagedllm.reasoning.abs_reasoning_parsers import ParsedReasoning, ReasoningParser, partial_marker_length

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkTagReasoningParser(ReasoningParser):
    """``<think>`` ... ``</think>`` then content (see the module docstring)."""

    start_tag = THINK_START
    end_tag = THINK_END

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        end = text.find(self.end_tag)
        if end < 0:
            held = 0 if final else partial_marker_length(text, (self.start_tag, self.end_tag))
            return ParsedReasoning(reasoning=self._without_start(text[: len(text) - held]))
        content = text[end + len(self.end_tag) :]
        return ParsedReasoning(reasoning=self._without_start(text[:end]), content=content)

    def is_reasoning_end(self, text: str) -> bool:
        """Whether the last tag of ``text`` is the end tag."""
        return text.rfind(self.end_tag) > text.rfind(self.start_tag)

    def _without_start(self, reasoning: str) -> str:
        before, tag, after = reasoning.partition(self.start_tag)
        return before + after if tag else reasoning
