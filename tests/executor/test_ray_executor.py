"""``RayDistributedExecutor`` (``distributed_executor_backend="ray"``):
multi-node on one machine (a ``ray.cluster_utils.Cluster`` of two 1-CPU nodes, so the
placement group must put one rank on each), the default backend becoming Ray once
connected (and, on GPUs, above the local devices), output identical to one process, a killed actor failing the next step at once;
and a cluster too small for the placement group refused at start-up with the numbers.

Ray start-up is slow (several processes per node), so each cluster starts once.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from pagedllm import LLM  # noqa: E402
from pagedllm.config import EngineArgs  # noqa: E402
from pagedllm.executor import ray_executor  # noqa: E402
from pagedllm.executor.multiproc_executor import MultiprocExecutor, WorkerDeadError  # noqa: E402
from pagedllm.executor.ray_executor import RayDistributedExecutor, assign_local_ranks  # noqa: E402
from pagedllm.executor.selector import get_executor_class  # noqa: E402
from tests.engine.test_tensor_parallel import ENGINE_KWARGS, _greedy, _prompts  # noqa: E402
from pagedllm.platforms import current_platform  # noqa: E402
from tests.helpers import cpu_only  # noqa: E402

pytestmark = [cpu_only, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def expected(tiny_llama):
    llm = LLM(str(tiny_llama), **ENGINE_KWARGS)
    return [o.outputs[0].token_ids for o in _greedy(llm, _prompts())]


def _token_ids(llm: LLM) -> list:
    return [o.outputs[0].token_ids for o in _greedy(llm, _prompts())]


def test_assign_local_ranks():
    assert assign_local_ranks(["a", "b", "a"]) == ([0, 0, 1], [2, 1, 2])


def test_workers_beyond_the_local_gpus_default_to_ray(tiny_llama, monkeypatch):
    """vLLM's rule on GPUs (``Platform.ray_beyond_local_devices``); on CPU ``mp`` refuses them."""
    config = EngineArgs(model=str(tiny_llama), dtype="float32", tensor_parallel_size=4).create_engine_config()

    def too_many(world_size):
        raise ValueError(f"{world_size} workers, 2 devices")

    monkeypatch.setattr(current_platform, "check_worker_count", too_many)
    assert get_executor_class(config) is MultiprocExecutor
    monkeypatch.setattr(current_platform, "ray_beyond_local_devices", True)
    assert get_executor_class(config) is RayDistributedExecutor
    monkeypatch.setattr(current_platform, "check_worker_count", lambda world_size: None)
    assert get_executor_class(config) is MultiprocExecutor


@pytest.fixture(scope="module")
def two_node_cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20})
    cluster.add_node(num_cpus=1, object_store_memory=80 << 20)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_two_nodes_one_rank_each_equal_one_process(two_node_cluster, tiny_llama, expected):
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **ENGINE_KWARGS)  # Ray connected: the default backend
    core = llm.llm_engine.engine_core
    executor = core.model_executor
    assert isinstance(executor, RayDistributedExecutor)
    assert not executor._started_ray
    cluster_nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert len(cluster_nodes) == 2 and set(executor.node_ids) == cluster_nodes  # one rank per node
    assert _token_ids(llm) == expected

    ray.kill(executor.workers[1])
    with pytest.raises(WorkerDeadError, match="A Ray worker actor died during execute_model"):
        _greedy(llm, _prompts()[:1])
    with pytest.raises(WorkerDeadError, match="The workers stopped earlier"):
        core.check_health()
    core.shutdown()
    assert ray.util.placement_group_table() and all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )


def test_a_cluster_too_small_is_refused_with_the_numbers(two_node_cluster, tiny_llama, monkeypatch):
    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 5.0)
    with pytest.raises(RuntimeError, match=r"cannot host the placement group of 4 bundles \{'CPU': 1.0\} .*"
                                           r"= 4\) within 5 s: the cluster has \{.*'CPU': 2.0"):
        LLM(str(tiny_llama), tensor_parallel_size=4, distributed_executor_backend="ray", **ENGINE_KWARGS)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp-experts", "ep"])
def test_mixture_of_experts_over_two_nodes_equals_transformers(two_node_cluster, checkpoint_factory, expert_parallel):
    """A Qwen3-MoE model with one rank per Ray node: experts split by their intermediate
    dimension (-tp 2), or whole experts per rank (--enable-expert-parallel); greedy tokens
    equal to transformers', the blocks all back after."""
    from tests.helpers import assert_greedy_equals_hf, check_block_accounting
    from tests.models.test_qwen3_moe import CONFIG

    path = checkpoint_factory("Qwen3MoeForCausalLM", seed=6, **CONFIG)
    llm = LLM(str(path), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ENGINE_KWARGS)
    try:
        assert isinstance(llm.llm_engine.engine_core.model_executor, RayDistributedExecutor)
        assert_greedy_equals_hf(llm, path)
        check_block_accounting(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
