"""``EngineClient`` (``pagedllm/engine/protocol.py``): ``AsyncLLM`` has every member, with the
protocol's signature, and the OpenAI front end takes its engine as an ``EngineClient``.
Structural checks on the classes: no engine is started."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.launcher import serve_http
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing

ATTRIBUTES = ["metrics_registry", "model_config", "processor"]
PROPERTIES = ["dead_error", "errored"]
COROUTINES = ["check_health", "do_log_stats", "is_sleeping", "sleep", "wake_up"]
ASYNC_GENERATORS = ["generate"]
FUNCTIONS = ["abort_all", "get_num_unfinished_requests", "get_tokenizer", "shutdown"]


def _members() -> set[str]:
    own = set(vars(EngineClient)) | set(EngineClient.__annotations__)
    return {name for name in own if not name.startswith("_")}


def _set_in_init(cls: type) -> set[str]:
    """The ``self.<name>`` attributes ``cls.__init__`` assigns."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name) and node.value.id == "self"
    }


def _parameters(function) -> list[tuple[str, object, bool]]:
    return [(p.name, p.kind, p.default is not p.empty) for p in inspect.signature(function).parameters.values()]


def test_the_protocol_lists_what_the_front_end_calls():
    assert sorted(_members()) == sorted(ATTRIBUTES + PROPERTIES + COROUTINES + ASYNC_GENERATORS + FUNCTIONS)


def test_async_llm_sets_every_protocol_attribute():
    assert sorted(set(ATTRIBUTES) - _set_in_init(AsyncLLM)) == []


@pytest.mark.parametrize("name", PROPERTIES)
def test_async_llm_has_the_protocol_properties(name):
    assert isinstance(inspect.getattr_static(EngineClient, name), property)
    assert isinstance(inspect.getattr_static(AsyncLLM, name), property)
    protocol_type = inspect.signature(inspect.getattr_static(EngineClient, name).fget).return_annotation
    assert inspect.signature(inspect.getattr_static(AsyncLLM, name).fget).return_annotation == protocol_type


@pytest.mark.parametrize("name", COROUTINES + ASYNC_GENERATORS + FUNCTIONS)
def test_async_llm_methods_match_the_protocol(name):
    """Same parameters (names, kinds, which have defaults), and calling it gives the same kind
    of thing: a coroutine, an async generator (the protocol writes ``generate`` as a plain
    method returning one, as typing wants), or a plain value."""
    ours, theirs = getattr(AsyncLLM, name), getattr(EngineClient, name)
    assert _parameters(ours) == _parameters(theirs)
    assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(theirs) == (name in COROUTINES)
    assert inspect.isasyncgenfunction(ours) == (name in ASYNC_GENERATORS)
    returns = inspect.signature(theirs).return_annotation
    assert returns.startswith("AsyncGenerator[") == (name in ASYNC_GENERATORS)
    if inspect.signature(ours).return_annotation is not inspect.Signature.empty:
        assert inspect.signature(ours).return_annotation == returns


@pytest.mark.parametrize("function", [build_app, serve_http, OpenAIServing.__init__], ids=lambda f: f.__qualname__)
def test_the_front_end_takes_an_engine_client(function):
    assert inspect.signature(function).parameters["engine"].annotation == "EngineClient"
