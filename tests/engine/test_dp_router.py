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


def test_a_shared_first_block_prefers_one_replica_within_the_margin():
    router = DPRouter(2, BLOCK)
    prefix = list(range(100, 100 + BLOCK))
    preferred = router.preferred_replica(request("x", prefix + [1]))
    assert preferred is not None
    # the tail after the first block does not matter; the salt and the adapter do
    assert router.preferred_replica(request("y", prefix + [7, 8, 9])) == preferred
    keys = {router.preferred_replica(request("z", prefix + [1], cache_salt=f"s{i}")) for i in range(16)}
    keys |= {router.preferred_replica(request("z", prefix, lora=LoRARequest(f"a{i}", i + 1))) for i in range(16)}
    assert keys == {0, 1}
    ranks = [router.route(request(f"r{i}", prefix + [i])) for i in range(2 + 2 * PREFIX_AFFINITY_MARGIN)]
    # the preferred replica takes them until it holds MARGIN more than the other, then they alternate
    assert ranks[: PREFIX_AFFINITY_MARGIN + 1] == [preferred] * (PREFIX_AFFINITY_MARGIN + 1)
    assert max(router.loads) - min(router.loads) <= PREFIX_AFFINITY_MARGIN + 1
    assert sum(router.loads) == len(ranks)


def test_split_cpus_gives_disjoint_shares_and_names_the_numbers():
    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cpus([4, 5, 6], 3) == [[4], [5], [6]]
    assert split_cpus([0, 1], 1) == [[0, 1]]
    with pytest.raises(ValueError, match=r"data_parallel_size=3 needs at least one CPU per replica; this process may run on 2 CPU\(s\) \(0, 1\)"):
        split_cpus([0, 1], 3)
