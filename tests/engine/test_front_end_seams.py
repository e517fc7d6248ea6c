"""One front end: the request validation point (``Processor``), the one ``n > 1`` fan-out
used by ``LLMEngine`` and ``AsyncLLM``, and ``LLMEngine`` on the engine-core client layer
(``client_factory.make_client`` -> ``InprocClient``)."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine import async_llm as async_llm_module
from pagedllm.engine import llm_engine as llm_engine_module
from pagedllm.engine import parallel_sampling
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_client import InprocClient
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.processor import ContextLengthError, Processor
from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.sampling_params import DEFAULT_MAX_TOKENS
from pagedllm.tokenizer import get_tokenizer

KV_BYTES = 8 << 20
MAX_MODEL_LEN = 512


def _engine_args(path) -> EngineArgs:
    return EngineArgs(model=str(path), dtype="float32", kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def processor(tiny_llama) -> Processor:
    config = _engine_args(tiny_llama).create_engine_config()
    return Processor(config.model_config, get_tokenizer(config.model_config.tokenizer_path))


def test_default_max_tokens_is_defined_once():
    assert SamplingParams().max_tokens == DEFAULT_MAX_TOKENS == 16


def test_resolve_max_tokens_default_bound_and_room(processor):
    assert processor.resolve_max_tokens(10, None) == 16  # completions: 16
    assert processor.resolve_max_tokens(MAX_MODEL_LEN - 4, None) == 4  # cut to the room left
    assert processor.resolve_max_tokens(10, None, default=None) == MAX_MODEL_LEN - 10  # chat: the rest
    assert processor.resolve_max_tokens(10, 700) == 700  # explicit: as given (the fit check reports it)
    assert processor.resolve_max_tokens(MAX_MODEL_LEN, None) == 16  # no room: the default, to report
    assert processor.resolve_max_tokens(MAX_MODEL_LEN, None, default=None) == 1
    with pytest.raises(ValueError, match=r"^max_completion_tokens must be at least 1, got 0\.$"):
        processor.resolve_max_tokens(10, 0, field="max_completion_tokens")
    with pytest.raises(ValueError, match=r"^max_tokens must be at least 1, got 0\.$"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize(
    "num_prompt, max_tokens, message",
    [
        (600, 16, "The prompt is 600 tokens long, but this model's maximum context length is 512 tokens"),
        (MAX_MODEL_LEN, None, "The prompt is 512 tokens long"),
        (500, 20, r"requested 520 tokens \(500 in the prompt, 20 for the completion\)"),
    ],
)
def test_context_fit_error_carries_the_numbers(processor, num_prompt, max_tokens, message):
    with pytest.raises(ContextLengthError, match=message) as info:
        processor.process("r", [5] * num_prompt, SamplingParams(max_tokens=max_tokens))
    error = info.value
    assert isinstance(error, ValueError)
    assert (error.num_prompt_tokens, error.num_completion_tokens, error.max_model_len) == (
        num_prompt,
        max_tokens,
        MAX_MODEL_LEN,
    )


def test_context_fit_runs_once_per_request(processor, monkeypatch):
    calls = []
    original = Processor.check_context_fit

    def spy(self, num_prompt_tokens, max_tokens):
        calls.append((num_prompt_tokens, max_tokens))
        return original(self, num_prompt_tokens, max_tokens)

    monkeypatch.setattr(Processor, "check_context_fit", spy)
    request, _ = processor.process("r", [5, 6, 7], SamplingParams(max_tokens=4))
    assert calls == [(3, 4)]
    assert isinstance(request, EngineCoreRequest)


def test_fan_out_children_share_the_prompt():
    params = SamplingParams(n=3, seed=7, max_tokens=4)
    request = EngineCoreRequest(
        request_id="p", prompt_token_ids=[1, 2, 3], sampling_params=params, eos_token_id=2, arrival_time=0.0
    )
    children = parallel_sampling.fan_out(request)
    assert [child.request_id for child, _, _ in children] == ["0_p", "1_p", "2_p"]
    assert [index for _, _, index in children] == [0, 1, 2]
    assert [child.sampling_params.seed for child, _, _ in children] == [7, 8, 9]
    assert all(child.sampling_params.n == 1 for child, _, _ in children)
    assert all(child.prompt_token_ids is request.prompt_token_ids for child, _, _ in children)
    parents = {id(parent) for _, parent, _ in children}
    assert len(parents) == 1 and children[0][1].request_id == "p"
    single = EngineCoreRequest(
        request_id="s", prompt_token_ids=[1], sampling_params=SamplingParams(), eos_token_id=2, arrival_time=0.0
    )
    assert parallel_sampling.fan_out(single) == [(single, None, 0)]


@pytest.fixture
def fan_out_spy(monkeypatch):
    """Counts fan-outs made through ``parallel_sampling.fan_out`` by either front end."""
    assert llm_engine_module.fan_out is parallel_sampling.fan_out
    assert async_llm_module.fan_out is parallel_sampling.fan_out
    calls = []
    original = parallel_sampling.fan_out

    def spy(request):
        calls.append(request.request_id)
        return original(request)

    monkeypatch.setattr(llm_engine_module, "fan_out", spy)
    monkeypatch.setattr(async_llm_module, "fan_out", spy)
    return calls


def test_llm_engine_goes_through_make_client_and_the_one_fan_out(tiny_llama, monkeypatch, fan_out_spy):
    made = []
    original = llm_engine_module.make_client

    def make_client(*args, **kwargs):
        client = original(*args, **kwargs)
        made.append((kwargs, client))
        return client

    monkeypatch.setattr(llm_engine_module, "make_client", make_client)
    engine = LLMEngine.from_engine_args(_engine_args(tiny_llama))
    [(kwargs, client)] = made
    assert kwargs == {"multiprocess": False, "asyncio_mode": False}
    assert isinstance(client, InprocClient) and engine.engine_core_client is client
    assert engine.engine_core is client.engine_core
    engine.add_request("req", [5, 6, 7], SamplingParams(n=2, max_tokens=3, ignore_eos=True, temperature=0))
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    assert fan_out_spy == ["req"]
    [out] = finished
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) == 3 for c in out.outputs)
    assert out.outputs[0].token_ids == out.outputs[1].token_ids  # greedy


def test_async_llm_uses_the_one_fan_out_and_accepts_a_processed_request(tiny_llama, fan_out_spy):
    llm = AsyncLLM.from_engine_args(_engine_args(tiny_llama), multiprocess=False)
    try:

        async def main():
            params = SamplingParams(n=2, max_tokens=3, ignore_eos=True, temperature=0)
            request, text = llm.processor.process("pre", {"prompt": "x", "prompt_token_ids": [5, 6, 7]}, params)
            outputs = [out async for out in llm.generate(request, params, "pre", prompt_text=text)]
            with pytest.raises(ValueError, match="is not 'other'"):
                await llm.add_request("other", request)
            return outputs

        outputs = asyncio.run(main())
    finally:
        llm.shutdown()
    assert fan_out_spy == ["pre"]
    final = outputs[-1]
    assert final.finished and final.prompt == "x"
    assert sorted(c.index for c in final.outputs) == [0, 1]
    assert all(len(c.token_ids) == 3 for c in final.outputs)
