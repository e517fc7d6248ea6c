"""``pagedllm serve -dp 2 --enable-expert-parallel`` on tiny mixture-of-experts checkpoints
written by transformers (Qwen3-MoE, Mixtral; 5 experts: 3 on engine 0, 2 on engine 1), with the
official ``openai`` client:

- concurrent greedy requests (eight: several per engine; chunked prefill, preemption) are
  token-identical to transformers (float32), both engines serve some, and every KV cache is
  empty afterwards;
- a single request (one engine idles, running dummy steps for the other's MoE layers), then a
  second batch: still token-identical (the engines' waves end and start again);
- the refusals at start-up (pipeline parallelism, fewer experts than engines, speculative
  decoding, sleep mode), each naming the flags; a dense model with --enable-expert-parallel
  keeps independent replicas.
"""

from __future__ import annotations

import asyncio
import os

import openai
import pytest

from pagedllm.config import EngineArgs
from tests.entrypoints.openai.parallel_serving import settled_metrics
from tests.helpers import cpu_only
from tests.models.utils import MAX_TOKENS, prompts_for, transformers_greedy
from tests.server_utils import RemoteServer

pytestmark = [cpu_only, pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two engines need two CPUs")]

MODEL_NAME = "moe"
QWEN3_MOE = dict(num_hidden_layers=2, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32,
                 intermediate_size=64, norm_topk_prob=True)
MIXTRAL = dict(num_hidden_layers=2, num_local_experts=5, num_experts_per_tok=2, intermediate_size=48)
#: 32-token steps over 8-token blocks, 16 blocks per engine for ~26 wanted: chunked prefill and preemption.
DP_EP = ("--served-model-name", MODEL_NAME, "-dp", "2", "--enable-expert-parallel", "--max-model-len", "128",
         "--block-size", "8", "--max-num-batched-tokens", "32", "--num-gpu-blocks-override", "16",
         "--no-enable-prefix-caching")


@pytest.fixture(scope="module", params=["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def moe_checkpoint(request, checkpoint_factory):
    config = QWEN3_MOE if request.param == "Qwen3MoeForCausalLM" else MIXTRAL
    return checkpoint_factory(request.param, seed=11, **config)


@pytest.fixture(scope="module")
def dp_ep_server(moe_checkpoint):
    remote = RemoteServer(moe_checkpoint, *DP_EP)
    try:
        yield remote
    finally:
        remote.close()


async def _greedy_at_once(client: openai.AsyncOpenAI, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy completion token ids, all requests at once."""

    async def one(prompt: list[int]) -> list[int]:
        reply = await client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        return [int(token.removeprefix("token_id:")) for token in reply.choices[0].logprobs.tokens]

    return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))


def _greedy(server: RemoteServer, prompts: list[list[int]]) -> list[list[int]]:
    return asyncio.run(_greedy_at_once(server.async_client(timeout=120), prompts))


def _finished_by_engine(metrics: dict[str, float]) -> list[float]:
    return [metrics.get(f"pagedllm:request_success_total{{engine={e},finished_reason=length}}", 0.0) for e in "01"]


def test_concurrent_and_single_requests_equal_transformers(dp_ep_server, moe_checkpoint):
    prompts = prompts_for(1024)
    expected = transformers_greedy(moe_checkpoint, prompts)
    before = _finished_by_engine(settled_metrics(dp_ep_server))
    assert _greedy(dp_ep_server, prompts * 2) == expected * 2
    after = settled_metrics(dp_ep_server)
    served = [a - b for a, b in zip(_finished_by_engine(after), before)]
    assert sum(served) == 2 * len(prompts) and min(served) >= 2, served  # several requests on each engine
    assert _greedy(dp_ep_server, prompts[3:]) == expected[3:]  # one request: the other engine idles
    assert _greedy(dp_ep_server, prompts[:2]) == expected[:2]  # a new wave after the idle one
    settled = settled_metrics(dp_ep_server)
    assert sum(settled[f"pagedllm:num_preemptions_total{{engine={e}}}"] for e in "01") > 0
    for e in "01":  # the block-accounting check the server exposes: nothing held, nothing running
        assert settled[f"pagedllm:kv_cache_usage_perc{{engine={e}}}"] == 0.0
        assert settled[f"pagedllm:num_requests_running{{engine={e}}}"] == 0.0
    log = dp_ep_server.log_text()
    assert "Traceback" not in log, log
    for engine, (first, last) in enumerate([(0, 2), (3, 4)]):  # 5 experts: 3 and 2
        assert f"engine {engine} holds experts {first}-{last} of 5 in each of 2 MoE layers" in log, log


def _config_error(model, **kwargs) -> str:
    args = EngineArgs(model=str(model), data_parallel_size=2, enable_expert_parallel=True, usage_context="api_server",
                      dtype="float32", **kwargs)
    with pytest.raises(ValueError) as error:
        args.create_engine_config()
    return str(error.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(pipeline_parallel_size=2), "--pipeline-parallel-size 2"),
    (dict(tensor_parallel_size=2), "--tensor-parallel-size 2"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}),
     "--speculative-config"),
    (dict(enable_sleep_mode=True), "--enable-sleep-mode"),
], ids=["pp", "tp", "spec-decode", "sleep-mode"])
def test_what_is_not_built_is_refused_naming_the_flags(checkpoint_factory, kwargs, message):
    model = checkpoint_factory("Qwen3MoeForCausalLM", seed=11, **QWEN3_MOE)
    text = _config_error(model, **kwargs)
    assert "--data-parallel-size 2 with --enable-expert-parallel is not supported yet" in text and message in text


def test_fewer_experts_than_engines_is_refused(checkpoint_factory):
    model = checkpoint_factory("Qwen3MoeForCausalLM", seed=11, **dict(QWEN3_MOE, num_experts=2, num_experts_per_tok=1))
    args = EngineArgs(model=str(model), data_parallel_size=3, enable_expert_parallel=True, usage_context="api_server")
    with pytest.raises(ValueError, match="--data-parallel-size 3 with --enable-expert-parallel needs at least 3 "
                                         "experts per layer .*Qwen3MoeForCausalLM has 2"):
        args.create_engine_config()


def test_a_dense_model_keeps_independent_replicas(tiny_llama):
    args = EngineArgs(model=str(tiny_llama), data_parallel_size=2, enable_expert_parallel=True,
                      usage_context="api_server", enable_sleep_mode=True)
    parallel = args.create_engine_config().parallel_config
    assert parallel.enable_expert_parallel and not parallel.data_parallel_expert_parallel
