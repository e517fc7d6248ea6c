"""Tool calling in chat completions: which parser reads a request's output, the reply's
``tool_calls`` and ``finish_reason``, and the streamed tool-call deltas.

``tool_choice`` (vLLM's behaviour):

- "none", or no ``tools``: the tools are rendered into the prompt, the output is content.
- "auto": the server's ``--tool-call-parser`` reads calls from the model's text; without
  ``--enable-auto-tool-choice`` the request is a 400.
- "required" / named: the engine constrains the output to JSON
  (``protocol.tool_call_json_schema``), read by ``RequiredToolParser`` / ``NamedToolParser``;
  its grammar ends after the one call of a named choice, or of "required" with
  ``parallel_tool_calls`` false.

``finish_reason`` is "tool_calls" when calls were made in "auto" or "required" mode and
the model stopped by itself; a named choice keeps "stop" (vLLM and OpenAI), and a call cut
off by ``max_tokens`` keeps "length" (its arguments are the text generated so far).
"""

from __future__ import annotations

import uuid
from typing import Optional

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagedllm.entrypoints.openai.tool_parsers import (
    NamedToolParser,
    ParsedOutput,
    ParsedToolCall,
    RequiredToolParser,
    ToolParser,
)


def tool_call_id() -> str:
    """A unique call id, OpenAI's form: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def request_tool_parser(request: ChatCompletionRequest, auto_parser: Optional[type[ToolParser]]) -> Optional[ToolParser]:
    """The parser of a request's output; None when the output is plain content.

    ``auto_parser`` is the ``--tool-call-parser`` class when ``--enable-auto-tool-choice``
    is on. A parser whose markers may be special tokens turns ``skip_special_tokens`` off
    for the request (vLLM's ``adjust_request``).

    Raises:
        OpenAIServingError: 400 for "auto" without ``auto_parser`` (vLLM's message).
    """
    choice = request.tool_choice
    if not request.tools or choice == "none":
        return None
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        return NamedToolParser(choice.function.name)
    if choice == "required":
        return RequiredToolParser()
    if auto_parser is None:
        raise bad_request(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            param="tool_choice",
        )
    parser = auto_parser()
    if parser.keeps_special_tokens:
        request.skip_special_tokens = False
    return parser


def called_tools(request: ChatCompletionRequest, parsed: ParsedOutput) -> list[ParsedToolCall]:
    """The calls a reply reports: only the first one when ``parallel_tool_calls`` is false
    (vLLM's ``maybe_filter_parallel_tool_calls``)."""
    return parsed.tool_calls if request.parallel_tool_calls is not False else parsed.tool_calls[:1]


def finish_reason(request: ChatCompletionRequest, engine_reason: Optional[str], called: bool) -> Optional[str]:
    """The choice's ``finish_reason`` (see the module docstring)."""
    named = isinstance(request.tool_choice, ChatCompletionNamedToolChoiceParam)
    if called and engine_reason == "stop" and not named:
        return "tool_calls"
    return engine_reason


def reply_tool_calls(request: ChatCompletionRequest, parsed: ParsedOutput) -> tuple[Optional[str], list[ToolCall]]:
    """The non-streamed reply: its ``content`` (None when calls were made and no text is
    left) and its ``tool_calls``, each with a new id."""
    calls = [
        ToolCall(id=tool_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
        for call in called_tools(request, parsed)
    ]
    return (parsed.content or None) if calls else parsed.content, calls


class ToolCallStream:
    """The streamed deltas of one choice whose output a tool parser reads.

    Each ``feed`` parses the text so far and sends what grew since the last one: content
    (appended), new calls (index, id, type, name and the arguments known so far), and
    argument fragments. Because partial snapshots are prefixes of the final parse
    (``ToolParser``), the joined deltas equal the non-streamed reply.

    NOTE: one case cannot be exact: a call that turns out malformed only after its name
    was sent (e.g. invalid JSON late in its arguments). What was sent stays sent; the
    non-streamed reply shows that call's text as content.
    """

    def __init__(self, request: ChatCompletionRequest, parser: ToolParser) -> None:
        self.request = request
        self.parser = parser
        self.text = ""
        self.content_sent = ""
        self.arguments_sent: list[str] = []

    @property
    def called(self) -> bool:
        """Whether a call has been sent."""
        return bool(self.arguments_sent)

    def feed(self, delta_text: str, final: bool) -> DeltaMessage:
        """The delta for ``delta_text``, the next piece of the output (``final``: the last)."""
        self.text += delta_text
        parsed = self.parser.parse(self.text, final)
        content = None
        if parsed.content.startswith(self.content_sent) and len(parsed.content) > len(self.content_sent):
            content = parsed.content[len(self.content_sent) :]
            self.content_sent = parsed.content
        deltas = [
            delta
            for index, call in enumerate(called_tools(self.request, parsed))
            if (delta := self._call_delta(index, call)) is not None
        ]
        return DeltaMessage(content=content, tool_calls=deltas or None)

    def _call_delta(self, index: int, call: ParsedToolCall) -> Optional[DeltaToolCall]:
        if index == len(self.arguments_sent):
            self.arguments_sent.append(call.arguments)
            function = DeltaFunctionCall(name=call.name, arguments=call.arguments)
            return DeltaToolCall(index=index, id=tool_call_id(), type="function", function=function)
        sent = self.arguments_sent[index]
        if len(call.arguments) <= len(sent) or not call.arguments.startswith(sent):
            return None
        self.arguments_sent[index] = call.arguments
        return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.arguments[len(sent) :]))
