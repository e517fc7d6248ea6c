"""The checks every architecture's tests run: pagedllm's greedy output token-identical to
transformers' (float32) on a tiny random checkpoint, under the scheduling regimes that change
what attention sees (chunked prefill, preemption and recompute, prefix-cache hits), each run
ending with the block-accounting check.

An architecture's test module builds its checkpoint (``tests.fixtures.checkpoints.make_checkpoint``
takes any transformers architecture and config keys) and calls ``assert_scenario`` once per
scenario of ``SCENARIOS`` it parametrizes over; references are computed once per checkpoint.
A mixture-of-experts model over several workers: ``assert_moe_over_workers``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.worker.kv_cache_sizing import kv_cache_groups
from tests.helpers import check_block_accounting, float32_llm, hf_greedy, hf_log_softmax, random_prompts

#: Prompt lengths: short, one block, and past the 16-32 token windows the tests use.
PROMPT_LENGTHS = (3, 17, 45, 90)
MAX_TOKENS = 10

#: Engine arguments of each scenario (``float32_llm``'s; ``kv_blocks`` sizes the cache in blocks).
SCENARIOS: dict[str, dict] = {
    # Small blocks and 16-token steps: prefill chunks cross block and window boundaries, and
    # decodes share steps with chunks.
    "chunked_prefill": {"block_size": 8, "max_num_batched_tokens": 16},
    # Too few blocks for the batch (the prompts twice, 16 blocks of 8 tokens): requests are
    # preempted and recomputed.
    "preemption": {"block_size": 8, "max_model_len": 128, "kv_blocks": 16, "enable_prefix_caching": False},
    # The prompts again after a first pass: prefix-cache hits must give the cold run's tokens.
    "prefix_caching": {"block_size": 8, "enable_prefix_caching": True},
}

_references: dict[tuple, list[list[int]]] = {}


def prompts_for(vocab_size: int, lengths=PROMPT_LENGTHS, seed: int = 7) -> list[list[int]]:
    """Random prompts of ``lengths`` tokens (the longest two share their first 40 tokens, so a
    second pass hits the prefix cache across requests too)."""
    prompts = random_prompts(list(lengths), vocab_size, seed=seed)
    if len(prompts) >= 2 and len(prompts[-2]) >= 40:
        prompts[-1][:40] = prompts[-2][:40]
    return prompts


def transformers_greedy(path: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """transformers' greedy completions of ``prompts`` (cached per checkpoint and prompts)."""
    key = (str(path), tuple(map(tuple, prompts)), max_tokens)
    if key not in _references:
        _references[key] = [hf_greedy(path, p, max_tokens) for p in prompts]
    return _references[key]


def assert_scenario(path: Path, scenario: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS,
                    llm: Optional[LLM] = None, **engine_kwargs) -> LLM:
    """Run ``prompts`` through an engine of ``SCENARIOS[scenario]`` (plus ``engine_kwargs``) and
    assert each greedy completion equals transformers'; the preemption scenario must preempt,
    the prefix-caching one must hit on its second pass. Ends with the block-accounting check.

    Returns:
        the engine (pass it as ``llm`` to reuse it for another check).
    """
    kwargs = {**SCENARIOS[scenario], **engine_kwargs}
    if "kv_blocks" in kwargs:
        kwargs = _with_windowed_cache(path, kwargs)
    llm = llm or float32_llm(path, kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    expected = transformers_greedy(path, prompts, max_tokens)
    passes = 2 if scenario == "prefix_caching" else 1
    batch, expected = (prompts * 2, expected * 2) if scenario == "preemption" else (prompts, expected)
    for attempt in range(passes):
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        for prompt, output, ref in zip(batch, outputs, expected):
            assert list(output.outputs[0].token_ids) == ref, (
                f"{scenario} (pass {attempt + 1}): the {len(prompt)}-token prompt diverged from transformers"
            )
        if attempt == 1:
            assert sum(o.num_cached_tokens or 0 for o in outputs) > 0, "the second pass hit no cached block"
    if scenario == "preemption":
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0, "the scenario did not preempt"
    check_block_accounting(llm)
    return llm


def _with_windowed_cache(path: Path, kwargs: dict) -> dict:
    """``kwargs`` for a model with sliding windows or chunked local attention: 16-token steps
    (such a KV-cache group holds its window or chunk plus a step's tokens per request) and
    ``kv_blocks`` one block more than one ``max_model_len`` request can hold over all groups
    (so requests still outgrow the cache); ``kwargs`` itself without them."""
    engine_args = {k: v for k, v in kwargs.items() if k != "kv_blocks"}
    config = EngineArgs(model=str(path), dtype="float32", **engine_args).create_engine_config()
    if config.model_config.sliding_window is None and config.model_config.attention_chunk_size is None:
        return kwargs
    engine_args.setdefault("max_num_batched_tokens", 16)
    groups = kv_cache_groups(EngineArgs(model=str(path), dtype="float32", **engine_args).create_engine_config())
    needed = groups.max_num_blocks_per_request(config.model_config.max_model_len, engine_args["max_num_batched_tokens"])
    return {**engine_args, "kv_blocks": needed + 1}


def assert_logprobs_match(llm: LLM, path: Path, prompt: list[int], max_tokens: int = 4, tol: float = 1e-3) -> None:
    """The greedy tokens' logprobs for ``prompt`` equal transformers' log-softmax (float32)
    within ``tol``: what greedy tokens cannot show (a logit scale or soft cap keeps the argmax)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    completion = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    reference = hf_log_softmax(path, prompt + list(completion.token_ids))
    for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        expected = reference[len(prompt) - 1 + j, token].item()
        assert abs(entry[token].logprob - expected) < tol, f"token {j}: logprob {entry[token].logprob} vs {expected}"
    check_block_accounting(llm)


def _expert_shards(worker) -> list[tuple[int, int, int]]:
    """(first expert, experts, intermediate columns) of each ``FusedMoE`` on ``worker``."""
    from pagedllm.model_executor.layers.fused_moe import FusedMoE

    return [(m.expert_start, m.local_num_experts, m.intermediate_size_per_partition)
            for m in worker.model_runner.model.modules() if isinstance(m, FusedMoE)]


def assert_moe_over_workers(path: Path, prompts: list[list[int]], shards: list[tuple[int, int, int]],
                            num_moe_layers: int, **engine_kwargs) -> None:
    """A mixture-of-experts model on an engine of ``engine_kwargs`` over several workers: the
    prompts twice per batch, two passes (the batch must preempt, the second pass must hit the
    prefix cache), each greedy completion transformers'; worker i's ``num_moe_layers``
    ``FusedMoE`` layers each hold ``shards[i]`` (first expert, experts, intermediate columns). Ends with the block-accounting
    check and shuts the engine down."""
    expected = transformers_greedy(path, prompts)
    llm = LLM(str(path), **engine_kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        cached = []
        for _ in range(2):  # the second pass hits the prefix cache
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outputs] == expected * 2
            cached.append(sum(o.num_cached_tokens or 0 for o in outputs))
        core = llm.llm_engine.engine_core
        assert core.scheduler.num_preemptions > 0 and cached[1] > 0
        expected_shards = [[shard] * num_moe_layers for shard in shards]
        assert core.model_executor.collective_rpc(_expert_shards) == expected_shards
        check_block_accounting(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
