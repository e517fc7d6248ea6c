"""``PromptRenderer``: request input -> prompt text and token ids, shared by the generating
endpoints and ``/tokenize`` (so both tokenize and apply the chat template the same way).

The server's ``--chat-template`` is loaded once, at start-up (``chat_utils.load_chat_template``);
the renderer holds the loaded text.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import jinja2

from pagedllm.entrypoints.chat_utils import (
    ChatImage,
    ChatOptionsError,
    MissingChatTemplateError,
    apply_chat_template,
    render_media_chat,
    MediaPartError,
)
from pagedllm.entrypoints.chat_content_format import resolve_content_format, template_text
from pagedllm.engine.processor import check_unicode
from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, TokenizeChatRequest

#: A request carrying a conversation to render.
ChatRequest = Union[ChatCompletionRequest, TokenizeChatRequest]


class PromptRenderer:
    """Tokenizes prompts and renders conversations with the chat template.

    Args:
        tokenizer: the engine's HF tokenizer.
        chat_template: the server's ``--chat-template`` text (already loaded), or None
            for the tokenizer's own.
        image_placeholder: an image-text model's image token text (``chat_utils.image_placeholder``);
            None: a text-only model, whose messages' image parts are refused.
        video_placeholder: a video model's video text (``chat_utils.video_placeholder``); None:
            video parts are refused.
        content_format: ``--chat-template-content-format`` ("auto", "string" or "openai";
            ``chat_content_format``).
    """

    def __init__(self, tokenizer: Any, chat_template: Optional[str] = None,
                 image_placeholder: Optional[str] = None, video_placeholder: Optional[str] = None,
                 content_format: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.image_placeholder = image_placeholder
        self.video_placeholder = video_placeholder
        self.content_format = content_format

    def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """The token ids of ``text``.

        Raises:
            OpenAIServingError: 400 (``param`` names the request field the text came from)
                when ``text`` holds a lone UTF-16 surrogate (JSON allows ``"\\ud800"``; it is
                no character, so no tokenizer takes it).
        """
        try:
            check_unicode(text, param)
        except ValueError as exc:
            raise bad_request(str(exc), param=param) from None
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(self, request: ChatRequest) -> str:
        """The prompt text of ``render_chat_media``."""
        return self.render_chat_media(request)[0]

    def render_chat_media(self, request: ChatRequest) -> tuple[str, list[ChatImage]]:
        """The prompt text of a request's conversation, as the request asks for it, and its
        images (``chat_utils.render_media_chat``: each one's placeholder is in the text, where
        the template puts it when it renders media parts itself).

        The template is the request's ``chat_template``, else the server's, else the
        tokenizer's, given each message's content in the server's content format (under "auto",
        the one that template takes: ``chat_content_format.detect_content_format``); the request's ``tools`` are rendered whatever its ``tool_choice``
        (vLLM's default); ``add_generation_prompt`` counts only when the request sets it (see
        ``chat_utils.resolve_chat_options``).

        Raises:
            OpenAIServingError: 400 when the options contradict each other, there is no
                template, the template fails on these messages, or an image part is refused
                (the message names it).
        """
        add_generation_prompt: Optional[bool] = None
        if "add_generation_prompt" in request.model_fields_set:
            add_generation_prompt = request.add_generation_prompt
        conversation = [message.to_template_dict() for message in request.messages]
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None

        chat_template = request.chat_template or self.chat_template

        def render(messages: list[dict[str, Any]], keep_parts: bool) -> str:
            return apply_chat_template(self.tokenizer, messages, chat_template, add_generation_prompt,
                                       request.continue_final_message, request.chat_template_kwargs, tools, keep_parts)

        template_format = resolve_content_format(self.content_format, template_text(self.tokenizer, chat_template, tools))
        try:
            text, images = render_media_chat(render, conversation, self.image_placeholder, self.video_placeholder,
                                             self.content_format, template_format)
        except ChatOptionsError as exc:
            raise bad_request(str(exc), param=exc.param) from None
        except MissingChatTemplateError:
            raise bad_request(
                "This model has no chat template; start the server with --chat-template "
                "(a file or a Jinja string) or pass chat_template in the request.",
                param="messages",
            ) from None
        except MediaPartError as exc:
            raise bad_request(str(exc), param="messages") from None
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise bad_request(f"Cannot apply the chat template to these messages: {exc}", param="messages") from None
        return text, images
