"""Process groups for model parallelism (``parallel_state``: tensor- and pipeline-parallel
groups and their collectives; ``shm_communicator``: the CPU collectives through shared memory)
and the arithmetic of sharding (``utils``)."""

from pagedllm.distributed.parallel_state import (
    destroy_distributed_environment,
    expert_parallel_enabled,
    get_comm_stats,
    get_dp_group,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
    reset_comm_stats,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pagedllm.distributed.utils import divide, get_open_port, kv_heads_per_rank

__all__ = [
    "destroy_distributed_environment",
    "divide",
    "expert_parallel_enabled",
    "get_comm_stats",
    "get_dp_group",
    "get_open_port",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_pp_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "init_distributed_environment",
    "initialize_model_parallel",
    "kv_heads_per_rank",
    "reset_comm_stats",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
