"""``--chat-template-content-format`` (``chat_content_format``, ``chat_utils``): which templates
take a message's content as a list of parts, and the exact prompt each format renders, against
transformers' ``apply_chat_template`` given the same messages."""

from __future__ import annotations

import logging

import pytest

from pagedllm.entrypoints.chat_content_format import (
    detect_content_format,
    log_content_format,
    resolve_content_format,
    template_text,
)
from pagedllm.entrypoints.chat_utils import apply_chat_template, render_media_chat
from tests.fixtures.checkpoints import CHAT_TEMPLATE

#: Takes parts: loops over each message's content (the test tokenizer's own template).
PARTS_TEMPLATE = CHAT_TEMPLATE
#: Takes strings: writes the content as it is.
STRING_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
PARTS = [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colours."}]
CONVERSATION = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": PARTS}]


@pytest.mark.parametrize(
    "template, expected",
    [
        (CHAT_TEMPLATE, "openai"),
        (STRING_TEMPLATE, "string"),
        # through an alias of messages, a slice and a filter on the content
        ("{% set loop_messages = messages[1:] %}{% for m in loop_messages %}"
         "{% for p in m.content | selectattr('type', 'equalto', 'text') %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
        # messages reassigned from a slice of itself, a system message read apart (Llama 3 style)
        ("{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}"
         "{%- set messages = messages[1:] %}{%- endif %}{{ system }}{%- for message in messages %}"
         "{%- if message['content'] is string %}{{ message['content'] }}{%- else %}"
         "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}<|image|>{%- else %}"
         "{{ part['text'] | trim }}{%- endif %}{%- endfor %}{%- endif %}{%- endfor %}", "openai"),
        # the loop inside transformers' {% generation %} block
        ("{% for m in messages %}{% generation %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
         "{% endgeneration %}{% endfor %}", "openai"),
        # a loop over something that is not a message's content
        ("{% for m in messages %}{% for c in m['tool_calls'] %}{{ c }}{% endfor %}{{ m['content'] }}{% endfor %}",
         "string"),
        ("{% for x in documents %}{% for p in x['content'] %}{{ p }}{% endfor %}{% endfor %}", "string"),
        ("{% for m in messages %", "string"),  # does not parse: the rendering reports it
    ],
)
def test_detect_content_format(template, expected):
    assert detect_content_format(template) == expected


def test_resolve_content_format_forces_and_refuses():
    assert resolve_content_format("auto", STRING_TEMPLATE) == "string"
    assert resolve_content_format("auto", None) == "string"
    assert resolve_content_format("openai", STRING_TEMPLATE) == "openai"
    assert resolve_content_format("string", PARTS_TEMPLATE) == "string"
    with pytest.raises(ValueError, match="must be one of auto, string, openai; got 'list'"):
        resolve_content_format("list", PARTS_TEMPLATE)


def _render(tokenizer, template, content_format, conversation=CONVERSATION):
    def render(messages, keep_parts):
        return apply_chat_template(tokenizer, messages, template, True, False, None, None, keep_parts)

    fmt = resolve_content_format(content_format, template_text(tokenizer, template))
    text, items = render_media_chat(render, conversation, None, None, content_format, fmt)
    assert items == []
    return text


def test_parts_template_gets_the_list(tokenizer):
    """A template that loops over parts gets them, under "auto": the prompt transformers
    renders from the same list (no newline between the parts)."""
    expected = tokenizer.apply_chat_template(CONVERSATION, chat_template=PARTS_TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
    assert expected == ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nName threecolours.<|im_end|>\n"
                        "<|im_start|>assistant\n")
    assert _render(tokenizer, PARTS_TEMPLATE, "auto") == expected
    assert _render(tokenizer, None, "auto") == expected  # the tokenizer's own template
    assert _render(tokenizer, PARTS_TEMPLATE, "openai") == expected


def test_string_template_gets_the_joined_text(tokenizer):
    """A template that writes the content as it is gets the text parts joined with newlines
    (vLLM's "string" format), under "auto" and when forced on a parts template."""
    joined = [CONVERSATION[0], {"role": "user", "content": "Name three\ncolours."}]
    expected = tokenizer.apply_chat_template(joined, chat_template=STRING_TEMPLATE, tokenize=False)
    assert expected == "[system]Be terse.[user]Name three\ncolours."
    assert _render(tokenizer, STRING_TEMPLATE, "auto") == expected
    assert _render(tokenizer, STRING_TEMPLATE, "string") == expected
    forced = tokenizer.apply_chat_template(joined, chat_template=PARTS_TEMPLATE, tokenize=False,
                                           add_generation_prompt=True)
    assert _render(tokenizer, PARTS_TEMPLATE, "string") == forced
    assert "Name three\ncolours." in forced


def test_openai_format_wraps_string_contents(tokenizer):
    """Forced "openai": every content reaches the template as a list, a string one as one
    text part, as vLLM passes them (a string template then writes the list)."""
    wrapped = [{"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
               {"role": "user", "content": PARTS}]
    expected = tokenizer.apply_chat_template(wrapped, chat_template=STRING_TEMPLATE, tokenize=False)
    assert expected.startswith("[system][{'type': 'text', 'text': 'Be terse.'}][user][{'type': 'text'")
    assert _render(tokenizer, STRING_TEMPLATE, "openai") == expected


def test_log_content_format_names_the_detected_format(caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm.entrypoints.chat_content_format"):
        assert log_content_format("auto", PARTS_TEMPLATE) == "openai"
        assert log_content_format("string", PARTS_TEMPLATE) == "string"
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0] == ("Detected the chat template content format to be 'openai'. You can set "
                           "--chat-template-content-format to override this.")
    assert messages[2] == "--chat-template-content-format string differs from the detected format 'openai'."


def test_media_parts_follow_a_forced_format(tokenizer):
    """An image part under a forced format: "string" puts the placeholder line before the
    text even for a template that renders parts; "openai" gives the parts (the image as
    ``{"type": "image"}``) even to a template that writes them as a string."""
    image_template = ("{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>"
                      "{% else %}{{ p['text'] }}{% endif %}{% endfor %}|{% endfor %}")
    conversation = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                 {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]

    def render_with(template, content_format):
        def render(messages, keep_parts):
            return apply_chat_template(tokenizer, messages, template, False, False, None, None, keep_parts)

        fmt = resolve_content_format(content_format, template)
        text, items = render_media_chat(render, conversation, "<image>", None, content_format, fmt)
        assert [item.url for item in items] == ["http://x/a.png"]
        return text

    assert render_with(image_template, "auto") == "What is this?<image>|"
    assert render_with(image_template, "openai") == "What is this?<image>|"
    # a string content: the placeholder line, then the text (a template that only loops over
    # parts iterates the string's characters and writes nothing of it)
    assert render_with(PARTS_TEMPLATE, "string") == "<|im_start|>user\n<image>\nWhat is this?<|im_end|>\n"
    assert render_with(image_template, "string") == "|"
    assert render_with(STRING_TEMPLATE, "auto") == "[user]<image>\nWhat is this?"
    assert render_with(STRING_TEMPLATE, "openai") == (
        "[user][{'type': 'text', 'text': 'What is this?'}, {'type': 'image'}]")


def test_null_content_is_empty_in_either_format():
    """A null (or missing) content, as of an assistant message with tool calls: "" for a
    string template, [] for a parts template (vLLM's)."""
    from pagedllm.entrypoints.chat_utils import template_messages

    conversation = [{"role": "assistant", "content": None}, {"role": "assistant"}]
    assert [m["content"] for m in template_messages(conversation)] == ["", ""]
    assert [m["content"] for m in template_messages(conversation, keep_parts=True)] == [[], []]
