"""How a chat template takes a message's ``content`` (vLLM's ``--chat-template-content-format``):
as one string ("string": text parts joined with newlines) or as a list of parts ("openai":
``[{"type": "text", "text": ...}, {"type": "image"}, ...]``).

``detect_content_format`` reads the template's Jinja syntax tree (jinja2's own parser, the one
transformers renders with): a template that loops over a message's ``content`` (``{% for part
in message['content'] %}``, through ``loop_messages = messages[1:]`` style aliases, filters and
slices) takes parts; any other takes a string. ``resolve_content_format`` applies the option.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any, Iterator, Optional

import jinja2
import jinja2.nodes as nodes

logger = logging.getLogger(__name__)

#: The option's values, vLLM's: "auto" detects, the others force a format.
CHAT_TEMPLATE_CONTENT_FORMATS = ("auto", "string", "openai")


def _unwrapped(node: nodes.Node) -> nodes.Node:
    """An expression without its filters, tests and slices (``x[1:] | reverse`` -> ``x``)."""
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            return node


def _root_name(node: nodes.Node) -> Optional[str]:
    """The variable an expression reads, through filters, tests and slices
    (``messages[1:] | reverse`` -> ``messages``); None for anything else."""
    node = _unwrapped(node)
    return node.name if isinstance(node, nodes.Name) and node.ctx == "load" else None


def _content_of(node: nodes.Node) -> Optional[str]:
    """The variable ``v`` of an expression ``v['content']`` / ``v.content`` (through filters,
    tests and slices); None for anything else."""
    node = _unwrapped(node)
    if isinstance(node, nodes.Getattr) and node.attr == "content":
        return _root_name(node.node)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content":
        return _root_name(node.node)
    return None


def _target_names(target: nodes.Node) -> Iterator[str]:
    """The names a ``for`` / ``set`` target binds (``m``, or ``i, m``)."""
    if isinstance(target, nodes.Name):
        yield target.name
    elif isinstance(target, nodes.Tuple):
        for item in target.items:
            yield from _target_names(item)


def _aliases(tree: nodes.Template, name: str) -> set[str]:
    """``name`` and every variable assigned from it, transitively (``{% set loop_messages =
    messages[1:] %}``)."""
    found, changed = {name}, True
    while changed:
        changed = False
        for assign in tree.find_all(nodes.Assign):
            if _root_name(assign.node) in found:
                new = set(_target_names(assign.target)) - found
                found |= new
                changed = changed or bool(new)
    return found


def loops_over_content(tree: nodes.Template) -> bool:
    """Whether the template has a ``for`` loop over a message's ``content``, a message being
    a loop variable over ``messages`` (or an alias of it)."""
    messages = _aliases(tree, "messages")
    loops = list(tree.find_all(nodes.For))
    message_vars = {name for loop in loops if _root_name(loop.iter) in messages for name in _target_names(loop.target)}
    return any(_content_of(loop.iter) in message_vars for loop in loops)


def _parse(chat_template: str) -> nodes.Template:
    """The template's syntax tree, parsed by the environment transformers renders it with
    (its ``{% generation %}`` tag and loop controls), else by a plain one."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(chat_template).environment.parse(chat_template)
    except ImportError:  # pragma: no cover - transformers is a dependency
        return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)


@lru_cache(maxsize=32)
def detect_content_format(chat_template: str) -> str:
    """"openai" when ``chat_template`` loops over a message's content parts
    (``loops_over_content``), else "string"; "string" too for a template that does not parse
    (the rendering then reports its error)."""
    try:
        tree = _parse(chat_template)
    except jinja2.TemplateError:
        return "string"
    return "openai" if loops_over_content(tree) else "string"


def template_text(tokenizer: Any, chat_template: Optional[str], tools: Optional[list] = None) -> Optional[str]:
    """The template a conversation is rendered with: ``chat_template``, else the tokenizer's
    (its ``tool_use`` one with ``tools``, as transformers picks); None when there is none."""
    if chat_template is not None:
        return chat_template
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    try:
        return tokenizer.get_chat_template(None, tools=tools)
    except (ValueError, AttributeError):
        return None


def resolve_content_format(given: str, chat_template: Optional[str]) -> str:
    """The format a template gets its contents in: ``given`` unless it is "auto", else
    ``detect_content_format`` ("string" without a template).

    Raises:
        ValueError: ``given`` is not one of ``CHAT_TEMPLATE_CONTENT_FORMATS``.
    """
    if given not in CHAT_TEMPLATE_CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {', '.join(CHAT_TEMPLATE_CONTENT_FORMATS)}; "
                         f"got {given!r}.")
    if given != "auto":
        return given
    return "string" if chat_template is None else detect_content_format(chat_template)


def log_content_format(given: str, chat_template: Optional[str]) -> str:
    """Log (as vLLM does at start-up) the format detected for ``chat_template``, with a warning
    when a forced ``given`` format differs from it; returns the format in use
    (``resolve_content_format``)."""
    detected = resolve_content_format("auto", chat_template)
    logger.info("Detected the chat template content format to be '%s'. You can set "
                "--chat-template-content-format to override this.", detected)
    if given not in ("auto", detected):
        logger.warning("--chat-template-content-format %s differs from the detected format '%s'.", given, detected)
    return resolve_content_format(given, chat_template)
