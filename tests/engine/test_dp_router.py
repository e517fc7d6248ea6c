"""``DPRouter``: least-loaded routing with prefix-cache affinity (plain Python, no processes),
and ``split_cpus``, the CPU shares of data-parallel replicas."""

from __future__ import annotations

import pytest

from pagedllm.engine.dp_router import PREFIX_AFFINITY_MARGIN, DPRouter
from pagedllm.lora.request import LoRARequest
from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.platforms.cpu import split_cpus
from pagedllm.sampling_params import SamplingParams

BLOCK = 16


def request(request_id: str, tokens: list[int], cache_salt=None, lora=None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, tokens, SamplingParams(), None, 0.0, cache_salt=cache_salt, lora_request=lora)


def test_short_prompts_go_to_the_least_loaded_replica():
    router = DPRouter(3, BLOCK)
    ranks = [router.route(request(f"r{i}", [i] * (BLOCK - 1))) for i in range(7)]
    assert ranks == [0, 1, 2, 0, 1, 2, 0]  # ties: the lowest index
    assert router.loads == [3, 2, 2]
    assert router.finish("r1") == 1 and router.finish("r1") is None  # finishing twice is harmless
    assert router.replica_of("r4") == 1 and router.replica_of("r1") is None
    assert router.route(request("r7", [5])) == 1  # the freed replica is the least loaded
    assert router.loads == [3, 2, 2]


def test_a_shared_first_block_follows_its_replica_within_the_margin():
    router = DPRouter(2, BLOCK)
    prefix = list(range(100, 100 + BLOCK))
    assert router.route(request("other", [1, 2, 3])) == 0  # a short prompt: no affinity
    assert router.route(request("first", prefix + [1])) == 1  # first seen: the least loaded
    # the same first block (any tail) follows it while replica 1 is at most MARGIN busier
    ranks = [router.route(request(f"r{i}", prefix + [7, i])) for i in range(PREFIX_AFFINITY_MARGIN + 1)]
    assert ranks == [1] * (PREFIX_AFFINITY_MARGIN + 1) and router.loads == [1, 2 + PREFIX_AFFINITY_MARGIN]
    assert router.route(request("spill", prefix)) == 0  # beyond the margin: the least loaded,
    assert router.route(request("next", prefix + [9])) == 0  # and the prefix follows it there
    # another cache salt or LoRA adapter is another first block: no affinity
    assert router.route(request("salted", prefix, cache_salt="s")) == 0
    router.finish("other")
    assert router.route(request("lora", prefix, lora=LoRARequest("a", 1))) == 0
    assert router.loads == [4, 4]


def test_split_cpus_gives_disjoint_shares_and_names_the_numbers():
    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cpus([4, 5, 6], 3) == [[4], [5], [6]]
    assert split_cpus([0, 1], 1) == [[0, 1]]
    with pytest.raises(ValueError, match=r"data_parallel_size=3 needs at least one CPU per replica; this process may run on 2 CPU\(s\) \(0, 1\)"):
        split_cpus([0, 1], 3)
