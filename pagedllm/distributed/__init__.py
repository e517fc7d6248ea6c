"""Process groups for model parallelism (``parallel_state``) and the arithmetic of sharding
(``utils``). Today the tensor-parallel group is this one process."""

from pagedllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    initialize_model_parallel,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pagedllm.distributed.utils import divide, kv_heads_per_rank

__all__ = [
    "divide",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "initialize_model_parallel",
    "kv_heads_per_rank",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
