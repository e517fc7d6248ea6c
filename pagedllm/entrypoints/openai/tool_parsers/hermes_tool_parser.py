"""``--tool-call-parser hermes``: calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks anywhere in the text (Hermes 2 Pro, Qwen 2.5 and later, the shipped model's template).
Source: vLLM's ``Hermes2ProToolParser``; NousResearch's Hermes function-calling format."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ToolParser,
    held_back,
)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import (
    MalformedCall,
    scan_call_object,
    skip_whitespace,
)
from pagedllm.entrypoints.openai.tool_parsers.registry import ToolParserManager

START = "<tool_call>"
END = "</tool_call>"


@ToolParserManager.register_module("hermes")
class HermesToolParser(ToolParser):
    """Each ``<tool_call>`` block holds one call object; text between blocks is content.
    A block that is not a call object (or has text after the object) stays in the content
    as written."""

    keeps_special_tokens = True

    def parse_text(self, text: str, final: bool) -> ParsedOutput:
        content: list[str] = []
        result = ParsedOutput(content="")
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                tail = text[pos:]
                content.append(tail if final else tail[: len(tail) - held_back(tail, START)])
                break
            content.append(text[pos:start])
            close = text.find(END, start)
            block_end = len(text) if close < 0 else close
            body = text[: block_end]
            try:
                scan = scan_call_object(body, skip_whitespace(body, start + len(START)))
                if close >= 0 and (scan.end is None or body[scan.end :].strip()):
                    raise MalformedCall("text after the call in a <tool_call> block")
            except ValueError:
                content.append(text[start : block_end + (len(END) if close >= 0 else 0)])
                if close < 0:
                    break
                pos = close + len(END)
                continue
            call = scan.to_call(body, final)
            if call is not None:
                result.tool_calls.append(call)
            elif final:
                content.append(text[start:])
            if close < 0:
                break
            pos = close + len(END)
        result.content = "".join(content)
        return result
