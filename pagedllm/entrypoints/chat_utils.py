"""Chat templates, for the offline ``LLM.chat`` and the OpenAI server alike: loading a
``--chat-template`` once (``load_chat_template``) and rendering a conversation into a
prompt (``apply_chat_template``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import jinja2


class MissingChatTemplateError(ValueError):
    """Neither the caller nor the tokenizer has a chat template."""


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """``--chat-template``: the text of a file, or the value itself when it is Jinja.

    As vLLM: a value naming a readable file is read; otherwise a value containing any of
    ``{``, ``}`` or a newline is taken as the template itself.

    Raises:
        ValueError: neither a file nor a template, or a template with a syntax error.
    """
    if value is None:
        return None
    text: Optional[str] = None
    try:
        path = Path(value).expanduser()
        if path.is_file():
            text = path.read_text(encoding="utf-8")
    except OSError:  # e.g. a long literal template is not a valid file name
        text = None
    if text is None:
        if not any(char in value for char in "{}\n"):
            raise ValueError(
                f"--chat-template {value!r} is neither a readable file nor a Jinja template."
            )
        text = value
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template has a Jinja syntax error (line {exc.lineno}): {exc.message}") from None
    return text


def apply_chat_template(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    chat_template: Optional[str],
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: Optional[dict[str, Any]] = None,
) -> str:
    """The prompt text of a conversation (a list of ``{"role", "content", ...}`` dicts).

    ``chat_template`` None means the tokenizer's own. With ``continue_final_message`` the
    last (assistant) message is left open and no generation prompt is added.
    ``chat_template_kwargs`` are passed to the template.

    Raises:
        MissingChatTemplateError: no ``chat_template`` and the tokenizer has none.
        jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError: the template
            failed on these messages.
    """
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise MissingChatTemplateError("The tokenizer has no chat template; pass chat_template=...")
    return tokenizer.apply_chat_template(
        conversation,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
        tokenize=False,
        **(chat_template_kwargs or {}),
    )
