"""``PromptRenderer``: request input -> prompt text and token ids, shared by the generating
endpoints and ``/tokenize`` (so both tokenize and apply the chat template the same way).

The server's ``--chat-template`` is loaded once, at start-up (``chat_utils.load_chat_template``);
the renderer holds the loaded text.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jinja2

from pagedllm.entrypoints.chat_utils import MissingChatTemplateError, apply_chat_template
from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.protocol import ChatMessage

#: Keyword arguments of ``apply_chat_template`` a request's ``chat_template_kwargs`` may not set.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message",
     "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs"}
)  # fmt: skip


class PromptRenderer:
    """Tokenizes prompts and renders conversations with the chat template.

    Args:
        tokenizer: the engine's HF tokenizer.
        chat_template: the server's ``--chat-template`` text (already loaded), or None
            for the tokenizer's own.
    """

    def __init__(self, tokenizer: Any, chat_template: Optional[str] = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The token ids of ``text``."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        chat_template: Optional[str],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: Optional[dict[str, Any]],
    ) -> str:
        """The prompt text of a conversation, as a request asks for it.

        ``chat_template``: the request's template, else the server's, else the tokenizer's.

        Raises:
            OpenAIServingError: 400 when there is no template, ``chat_template_kwargs``
                sets a reserved argument, or the template fails on these messages.
        """
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}.", param="chat_template_kwargs")
        conversation = [message.to_template_dict() for message in messages]
        try:
            return apply_chat_template(
                self.tokenizer,
                conversation,
                chat_template or self.chat_template,
                add_generation_prompt,
                continue_final_message,
                kwargs,
            )
        except MissingChatTemplateError:
            raise bad_request(
                "This model has no chat template; start the server with --chat-template "
                "(a file or a Jinja string) or pass chat_template in the request.",
                param="messages",
            ) from None
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise bad_request(f"Cannot apply the chat template to these messages: {exc}", param="messages") from None
