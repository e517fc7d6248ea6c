"""Chat templates, for the offline ``LLM.chat`` and the OpenAI server alike: loading a
``--chat-template`` once (``load_chat_template``) and rendering a conversation into a
prompt (``apply_chat_template``, which applies the one set of rules on the rendering
options: ``resolve_chat_options``, and hands tool calls to templates as they expect them:
``template_messages``); and, for an image-text model, taking a conversation's images out of
its messages (``conversation_images``: OpenAI's ``image_url`` parts) and loading them
(``load_chat_images``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import jinja2


#: Keyword arguments of ``apply_chat_template`` that ``chat_template_kwargs`` may not set.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message",
     "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs"}
)  # fmt: skip


class MissingChatTemplateError(ValueError):
    """Neither the caller nor the tokenizer has a chat template."""


class MediaPartError(ValueError):
    """An image or video part a model cannot take, or without its url; the message names it."""


class ChatOptionsError(ValueError):
    """Rendering options that cannot go together; ``param`` names the offending option."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def resolve_chat_options(
    add_generation_prompt: Optional[bool],
    continue_final_message: bool,
    chat_template_kwargs: Optional[dict[str, Any]],
) -> tuple[bool, dict[str, Any]]:
    """(add_generation_prompt, template kwargs) of a chat to render: the rules of every way
    of rendering one (``LLM.chat``, ``/v1/chat/completions``, ``/tokenize``).

    ``add_generation_prompt`` None (a request that leaves it out) means "true unless
    ``continue_final_message``". Both true is refused, as vLLM and transformers refuse it
    (the final message cannot be continued after a new assistant header).

    Raises:
        ChatOptionsError: both are true, or ``chat_template_kwargs`` sets one of
            ``RESERVED_TEMPLATE_KWARGS``.
    """
    if continue_final_message and add_generation_prompt:
        raise ChatOptionsError(
            "continue_final_message and add_generation_prompt cannot both be true: set "
            "add_generation_prompt to false to continue the final message.",
            param="continue_final_message",
        )
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise ChatOptionsError(f"chat_template_kwargs may not set {', '.join(reserved)}.", param="chat_template_kwargs")
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final_message
    return add_generation_prompt, kwargs


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


#: Content part types that carry an image (OpenAI's ``image_url``; vLLM's ``image_pil`` offline).
IMAGE_PART_TYPES = ("image_url", "image_pil")
#: Content part types that carry a video (vLLM's ``video_url``).
VIDEO_PART_TYPES = ("video_url",)
MEDIA_PART_TYPES = IMAGE_PART_TYPES + VIDEO_PART_TYPES


@dataclass(frozen=True)
class ChatImage:
    """One image (or video: ``modality``) of a conversation: ``where`` names its part
    (``messages[i].content[j]``); ``url`` (an ``image_url`` / ``video_url`` part's) or
    ``image`` (a PIL image, ``image_pil``)."""

    where: str
    url: Optional[str] = None
    image: Any = None
    modality: str = "image"


def conversation_images(conversation: list[dict[str, Any]], placeholder: Optional[str],
                        video_placeholder: Optional[str] = None) -> tuple[list[dict[str, Any]], list[ChatImage]]:
    """(the conversation with its image and video parts taken out, the items in order). A
    message with images gets a string content: a ``placeholder`` line per image (the model's
    image token, e.g. ``<image>``) or ``video_placeholder`` line per video, in the parts'
    order, then its text parts, joined with newlines, as vLLM renders media for templates that
    take string content. An ``image_url`` part is ``{"type": "image_url", "image_url": {"url":
    ..., "detail": ...}}`` (``detail`` is accepted and has no effect) or its url as a plain
    string; a ``video_url`` part likewise. The input is not changed.

    Raises:
        MediaPartError: an image for a text-only model (``placeholder`` None), a video for a model
            without videos (``video_placeholder`` None), or a part without a url; the message
            names the part.
    """
    messages, images = [], []
    for i, message in enumerate(conversation):
        parts = message.get("content")
        if not isinstance(parts, list) or not any(_part_type(p) in MEDIA_PART_TYPES for p in parts):
            messages.append(message)
            continue
        texts, found, lines = [], [], []
        for j, part in enumerate(parts):
            where = f"messages[{i}].content[{j}]"
            kind = _part_type(part)
            if kind not in MEDIA_PART_TYPES:
                texts.append(part)
                continue
            if placeholder is None:
                raise MediaPartError(f"{where}: {_article(kind)} {kind} part, but this model is text-only: it does not "
                                 "take images.")
            if kind in VIDEO_PART_TYPES and video_placeholder is None:
                raise MediaPartError(f"{where}: a {kind} part, but this model does not take videos.")
            found.append(_chat_image(part, where))
            lines.append(video_placeholder if kind in VIDEO_PART_TYPES else placeholder)
        images += found
        text = _joined_text(texts) if texts else None
        messages.append({**message, "content": "\n".join(lines + ([text] if texts else []))})
    return messages, images


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def openai_parts_conversation(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation in vLLM's "openai" content format, as a template that loops over a
    message's parts takes it: a string content as one ``{"type": "text", "text": ...}`` part,
    a null or missing one as ``[]``, text parts as that, each image part as ``{"type": "image"}``,
    each video part as ``{"type": "video"}``, other parts as they are. The input is not changed."""
    messages = []
    for message in conversation:
        parts = message.get("content")
        if parts is None:
            message = {**message, "content": []}
        elif isinstance(parts, str):
            message = {**message, "content": [{"type": "text", "text": parts}]}
        elif isinstance(parts, list):
            message = {**message, "content": [_openai_part(part) for part in parts]}
        messages.append(message)
    return messages


def _openai_part(part: Any) -> Any:
    kind = _part_type(part)
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind in MEDIA_PART_TYPES:
        return {"type": "video" if kind in VIDEO_PART_TYPES else "image"}
    return part


def render_media_chat(render: Callable[[list[dict[str, Any]], bool], str], conversation: list[dict[str, Any]],
                      placeholder: Optional[str], video_placeholder: Optional[str],
                      content_format: str = "auto", template_format: str = "string") -> tuple[str, list[ChatImage]]:
    """(prompt text, the items of ``conversation_images``) of a conversation, its contents in
    ``template_format`` ("string" or "openai": ``chat_content_format.resolve_content_format``
    of ``content_format``, the ``--chat-template-content-format`` option, and the template).
    ``render(conversation, keep_parts)`` applies the chat template; ``keep_parts`` gives it
    ``openai_parts_conversation``'s parts.

    A conversation with images or videos under "auto" is rendered by the template itself when
    it writes the model's placeholder for each item from the parts (as Qwen-VL's, Gemma 3's and
    Llava's own templates do), else from ``conversation_images``' string contents.

    Raises:
        MediaPartError: see ``conversation_images``; whatever ``render`` raises on the string form.
    """
    strings, items = conversation_images(conversation, placeholder, video_placeholder)
    if not items or content_format != "auto":
        use_parts = template_format == "openai"
        return render(conversation if use_parts else strings, use_parts), items
    try:
        text = render(conversation, True)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError):
        text = None  # a template that takes string contents only
    num_videos = sum(item.modality == "video" for item in items)
    if text is not None and text.count(placeholder or "") == len(items) - num_videos and (
            not num_videos or text.count(video_placeholder or "") == num_videos):
        return text, items
    return render(strings, False), items


def _part_type(part: Any) -> Optional[str]:
    return part.get("type") if isinstance(part, dict) else None


def _chat_image(part: dict[str, Any], where: str) -> ChatImage:
    kind = part["type"]
    if kind == "image_pil":
        return ChatImage(where, image=part.get("image_pil"))
    value = part.get(kind)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise MediaPartError(f"{where}: {_article(kind)} {kind} part needs {kind}.url.")
    return ChatImage(where, url=url, modality="video" if kind in VIDEO_PART_TYPES else "image")


def load_chat_images(images: Sequence[ChatImage], connector: Any, num_frames: Optional[int] = None
                     ) -> dict[str, list[Any]]:
    """The conversation's media as ``multi_modal_data``: ``{"image": PIL images, "video":
    ``VideoData``s}`` (the modalities present), each fetched by ``connector`` (a
    ``pagedllm.multimodal.media.MediaConnector``) unless given; a video decoded and sampled to
    ``num_frames`` (``--media-io-kwargs``' ``video.num_frames``; None: the default,
    ``pagedllm.multimodal.video.decode_video``).

    Raises:
        ValueError: ``"<part>: <why>"`` for the first item that cannot be loaded.
    """
    from PIL import Image

    from pagedllm.multimodal.video import DEFAULT_NUM_FRAMES, decode_video

    loaded: dict[str, list[Any]] = {}
    for item in images:
        if item.url is None:
            if not isinstance(item.image, Image.Image):
                raise ValueError(f"{item.where}: image_pil is a {type(item.image).__name__}, not a PIL image.")
            loaded.setdefault("image", []).append(item.image)
            continue
        try:
            if item.modality == "video":
                video = decode_video(connector.fetch_bytes(item.url, "video"),
                                     DEFAULT_NUM_FRAMES if num_frames is None else num_frames)
                loaded.setdefault("video", []).append(video)
            else:
                loaded.setdefault("image", []).append(connector.load_image(item.url))
        except ValueError as exc:
            raise ValueError(f"{item.where}: {exc}.") from None
    return loaded


def image_placeholder(model_config: Any, tokenizer: Any) -> Optional[str]:
    """The text ``conversation_images`` puts where a message's images go: the model's image
    token (Llava's ``<image>``), the layout's ``prompt_token_key`` token (Gemma 3's
    ``<start_of_image>``) or its ``chat_placeholder`` (Qwen-VL's
    ``<|vision_start|><|image_pad|><|vision_end|>``); None for a text-only model."""
    from pagedllm.multimodal.processing import MULTIMODAL_LAYOUTS

    layout = MULTIMODAL_LAYOUTS.get(getattr(model_config, "architecture", None))
    if layout is None:
        return None
    if layout.chat_placeholder is not None:
        return layout.chat_placeholder
    key = layout.prompt_token_key or layout.image_token_key
    return tokenizer.convert_ids_to_tokens(int(getattr(model_config.hf_config, key)))


def video_placeholder(model_config: Any) -> Optional[str]:
    """The text ``conversation_images`` puts where a message's videos go (Qwen-VL's
    ``<|vision_start|><|video_pad|><|vision_end|>``); None for a model without videos."""
    from pagedllm.multimodal.processing import MULTIMODAL_LAYOUTS

    layout = MULTIMODAL_LAYOUTS.get(getattr(model_config, "architecture", None))
    return layout.video_chat_placeholder if layout is not None else None


def media_connector(model_config: Any) -> Any:
    """A ``MediaConnector`` under the model's media settings (``MultiModalConfig``)."""
    from pagedllm.multimodal.media import MediaConnector

    mm_config = model_config.multimodal_config
    return MediaConnector(mm_config.allowed_local_media_path, mm_config.allowed_media_domains)


def multimodal_chat_prompt(processor: Any, text: str, media: dict[str, list[Any]],
                           mm_processor_kwargs: Optional[dict] = None, add_special_tokens: bool = False
                           ) -> dict[str, Any]:
    """The engine prompt of a rendered chat ``text`` with its loaded ``media``
    (``load_chat_images``' output), processed once by the engine's
    ``Processor.process_multimodal`` (``add_special_tokens``: the template writes them):
    ``{"prompt", "prompt_token_ids", "mm_features"}``.

    Raises:
        ValueError: see ``Processor.process_multimodal``.
    """
    prompt: dict[str, Any] = {"prompt": text, "multi_modal_data": media}
    if mm_processor_kwargs:
        prompt["mm_processor_kwargs"] = mm_processor_kwargs
    _, token_ids, features = processor.process_multimodal(prompt, add_special_tokens)
    return {"prompt": text, "prompt_token_ids": token_ids, "mm_features": features}


def template_messages(conversation: list[dict[str, Any]], keep_parts: bool = False) -> list[dict[str, Any]]:
    """The messages as chat templates expect them, as vLLM passes them: OpenAI's content
    parts (``[{"type": "text", "text": ...}, ...]``) joined with newlines into one string
    (vLLM's "string" content format; a null or missing content as ""), or with ``keep_parts``
    every content as a list of parts (its "openai" format: ``openai_parts_conversation``);
    the ``function.arguments`` of an assistant message's ``tool_calls`` decoded from JSON
    text to a dict (OpenAI sends a string; templates such as Qwen's and Llama's write
    ``arguments | tojson``); arguments that are not JSON stay as they are. The input is not
    changed.

    Raises:
        ValueError: a content part that is not text (images, audio ...).
    """
    messages = []
    for message in openai_parts_conversation(conversation) if keep_parts else conversation:
        if isinstance(message.get("content"), list) and not keep_parts:
            message = {**message, "content": _joined_text(message["content"])}
        elif message.get("content") is None:
            message = {**message, "content": ""}
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_decoded_call(call) for call in calls]}
        messages.append(message)
    return messages


def _joined_text(parts: list[Any]) -> str:
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"content parts of type {kind!r} are not supported; only 'text' parts are.")
        texts.append(part["text"])
    return "\n".join(texts)


def _decoded_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def apply_chat_template(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    chat_template: Optional[str],
    add_generation_prompt: Optional[bool],
    continue_final_message: bool,
    chat_template_kwargs: Optional[dict[str, Any]] = None,
    tools: Optional[list[dict[str, Any]]] = None,
    keep_parts: bool = False,
) -> str:
    """The prompt text of a conversation (a list of ``{"role", "content", ...}`` dicts).

    ``chat_template`` None means the tokenizer's own. With ``continue_final_message`` the
    last (assistant) message is left open. ``chat_template_kwargs`` are passed to the
    template. The options follow ``resolve_chat_options``. ``tools`` (OpenAI's
    ``{"type": "function", "function": {...}}`` dicts) reach the template as its ``tools``
    variable, as transformers passes them; messages go through ``template_messages``.

    Raises:
        ChatOptionsError: see ``resolve_chat_options``.
        MissingChatTemplateError: no ``chat_template`` and the tokenizer has none.
        jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError: the template
            failed on these messages.
    """
    add_generation_prompt, kwargs = resolve_chat_options(add_generation_prompt, continue_final_message, chat_template_kwargs)
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise MissingChatTemplateError("The tokenizer has no chat template; pass chat_template=...")
    return tokenizer.apply_chat_template(
        template_messages(conversation, keep_parts),
        tools=tools,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        **kwargs,
    )
