"""The OpenAI layer's seams, without a server: validation goes through the engine's
``Processor`` (same default, same check, once), ``OpenAIServing`` lives in
``serving_engine``, ``/tokenize`` needs no engine (it does not inherit the generating
base), one GPT-2 byte map, and one chat-template renderer for ``LLM.chat`` and the server."""

from __future__ import annotations

import asyncio
import pathlib
from types import SimpleNamespace
from unittest import mock

import pytest

from pagedllm.config import EngineArgs
from pagedllm.engine.detokenizer import _tokenizer_info
from pagedllm.engine.processor import ContextLengthError, Processor
from pagedllm.entrypoints.chat_utils import apply_chat_template
from pagedllm.entrypoints.openai import serving_engine
from pagedllm.entrypoints.openai.errors import OpenAIServingError
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
)
from pagedllm.entrypoints.openai.renderer import PromptRenderer
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams
from pagedllm.tokenizer import byte_level_char_to_byte, get_tokenizer

MAX_MODEL_LEN = 256
MESSAGES = [{"role": "user", "content": "hello there"}]


class _Engine:
    """What the serving classes use of an ``AsyncLLM``; ``generate`` records requests."""

    def __init__(self, processor: Processor, model_config) -> None:
        self.processor = processor
        self.model_config = model_config
        self.requests = []

    async def generate(self, request, sampling_params, request_id, prompt_text=None, trace_headers=None):
        self.requests.append((request, prompt_text))
        raise RuntimeError("stop here: the test inspects the engine request")
        yield  # an async generator


@pytest.fixture(scope="module")
def parts(tiny_llama):
    config = EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=MAX_MODEL_LEN).create_engine_config()
    tokenizer = get_tokenizer(config.model_config.tokenizer_path)
    processor = Processor(config.model_config, tokenizer)
    models = OpenAIServingModels(["m"], str(tiny_llama), MAX_MODEL_LEN)
    return SimpleNamespace(config=config, tokenizer=tokenizer, processor=processor, models=models)


def _serving(parts, cls):
    engine = _Engine(parts.processor, parts.config.model_config)
    return engine, cls(engine, parts.models, PromptRenderer(parts.tokenizer), log_requests=False)


def _run(coro):
    return asyncio.run(coro)


def test_serving_classes_share_one_base_and_tokenization_is_not_one():
    assert issubclass(OpenAIServingCompletion, OpenAIServing)
    assert issubclass(OpenAIServingChat, OpenAIServing)
    assert OpenAIServing.__module__ == "pagedllm.entrypoints.openai.serving_engine"
    assert not issubclass(OpenAIServingTokenization, OpenAIServing)


def test_server_and_offline_report_a_too_long_prompt_from_one_check(parts):
    too_long = [5] * (MAX_MODEL_LEN + 10)
    engine, completion = _serving(parts, OpenAIServingCompletion)
    original = Processor.check_context_fit
    with mock.patch.object(Processor, "check_context_fit", autospec=True, side_effect=original) as spy:
        with pytest.raises(ContextLengthError) as offline:
            parts.processor.process("offline", too_long, SamplingParams())
        with pytest.raises(OpenAIServingError) as server:
            _run(completion.create_completion(CompletionRequest(prompt=too_long)))
    expected = mock.call(parts.processor, MAX_MODEL_LEN + 10, DEFAULT_MAX_TOKENS)
    assert spy.call_args_list == [expected, expected]  # once each
    assert (offline.value.num_prompt_tokens, offline.value.num_completion_tokens) == (MAX_MODEL_LEN + 10, 16)
    error = server.value
    assert error.status_code == 400 and error.code == "context_length_exceeded" and error.param == "prompt"
    assert f"({MAX_MODEL_LEN + 10} in the prompt, 16 in the completion)" in error.message
    assert "Please reduce the length of the prompt or completion." in error.message
    assert engine.requests == []  # nothing reached the engine


def test_server_default_max_tokens_is_the_offline_default(parts):
    engine, completion = _serving(parts, OpenAIServingCompletion)
    with pytest.raises(RuntimeError, match="stop here"):
        _run(completion.create_completion(CompletionRequest(prompt="hello")))
    [(request, prompt_text)] = engine.requests
    assert request.sampling_params.max_tokens == SamplingParams().max_tokens == DEFAULT_MAX_TOKENS
    assert prompt_text == "hello" and request.request_id.startswith("cmpl-") and request.request_id.endswith("-0")
    engine, chat = _serving(parts, OpenAIServingChat)
    with pytest.raises(RuntimeError, match="stop here"):
        _run(chat.create_chat_completion(ChatCompletionRequest(messages=MESSAGES)))
    [(request, _)] = engine.requests
    assert request.sampling_params.max_tokens == MAX_MODEL_LEN - len(request.prompt_token_ids)  # chat: the rest


def test_tokenize_needs_no_engine_and_renders_as_chat_and_llm_chat(parts):
    renderer = PromptRenderer(parts.tokenizer)
    tokenization = OpenAIServingTokenization(parts.models, renderer, MAX_MODEL_LEN, parts.processor.vocab_size)
    response = _run(tokenization.tokenize(TokenizeChatRequest(messages=MESSAGES)))
    _, chat = _serving(parts, OpenAIServingChat)
    prompt = chat.render_prompt(ChatCompletionRequest(messages=MESSAGES))
    offline_text = apply_chat_template(parts.tokenizer, MESSAGES, None, True, False)
    assert prompt.text == offline_text
    assert response.tokens == prompt.token_ids == parts.tokenizer.encode(offline_text, add_special_tokens=False)
    assert response.max_model_len == MAX_MODEL_LEN


def test_one_gpt2_byte_map(parts):
    char_to_byte = byte_level_char_to_byte()
    assert len(char_to_byte) == 256 and sorted(char_to_byte.values()) == list(range(256))
    assert char_to_byte["Ġ"] == ord(" ") and char_to_byte["!"] == ord("!")
    assert serving_engine._byte_level_decoder(parts.tokenizer) is char_to_byte
    info = _tokenizer_info(parts.tokenizer)
    assert info.token_bytes is not None
    space_id = parts.tokenizer.convert_tokens_to_ids("Ġ")
    if space_id != parts.tokenizer.unk_token_id:
        assert info.token_bytes[space_id] == b" "
    package = pathlib.Path(serving_engine.__file__).resolve().parents[2]
    defining = sorted(
        str(p.relative_to(package)) for p in package.rglob("*.py") if "bytes_to_unicode" in p.read_text()
    )
    assert defining == ["tokenizer.py"]


def test_byte_level_decoder_read_from_the_decoder_alone():
    """Byte-level BPE is told by the tokenizer's decoder (a ByteLevel one, alone or in a
    sequence); other decoders, none, or no backend tokenizer: None."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, decoders, models

    def wrapped(decoder):
        backend = Tokenizer(models.BPE())
        if decoder is not None:
            backend.decoder = decoder
        return SimpleNamespace(backend_tokenizer=backend)

    char_to_byte = byte_level_char_to_byte()
    assert serving_engine._byte_level_decoder(wrapped(decoders.ByteLevel())) is char_to_byte
    assert serving_engine._byte_level_decoder(wrapped(decoders.Sequence([decoders.ByteLevel()]))) is char_to_byte
    assert serving_engine._byte_level_decoder(wrapped(decoders.WordPiece())) is None
    assert serving_engine._byte_level_decoder(wrapped(None)) is None
    assert serving_engine._byte_level_decoder(SimpleNamespace()) is None


@pytest.mark.parametrize("event", [None, "response.output_text.delta"])
def test_sse_events_survive_line_readers_that_split_on_unicode_breaks(event):
    """A generated token holding U+2028, U+2029 or U+0085 stays inside its event: httpx's
    ``iter_lines`` (``str.splitlines``) reads the event as its lines, and the JSON value is the text."""
    import json

    import httpx

    text = "a\u2028b\u2029c\x85d"
    wire = serving_engine.sse(json.dumps({"text": text}, ensure_ascii=False), event=event)
    lines = [line for line in httpx.Response(200, content=wire.encode()).iter_lines() if line]
    assert len(lines) == (1 if event is None else 2), lines
    assert json.loads(lines[-1].removeprefix("data: ")) == {"text": text}
    if event is not None:
        assert lines[0] == f"event: {event}"
