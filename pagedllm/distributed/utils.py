"""The arithmetic of splitting a model across tensor-parallel ranks and pipeline stages."""

from __future__ import annotations

from pagedllm import envs
from pagedllm.network import get_open_port  # noqa: F401  (re-exported)


def divide(numerator: int, denominator: int) -> int:
    """``numerator / denominator`` for sizes that must split evenly across ranks.

    Raises:
        ValueError: if ``denominator`` is not positive or does not divide ``numerator``.
    """
    if denominator <= 0 or numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}: it cannot be split evenly across ranks.")
    return numerator // denominator


def kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> int:
    """KV heads each of ``tp_size`` ranks holds: ``total / tp_size``, or 1 when there are at
    least as many ranks as KV heads (each head is then replicated on ``tp_size / total``
    ranks, as vLLM does).

    Raises:
        ValueError: if neither count divides the other.
    """
    if tp_size >= total_num_kv_heads:
        divide(tp_size, total_num_kv_heads)
        return 1
    return divide(total_num_kv_heads, tp_size)


#: Environment variable overriding the even split of layers over pipeline stages: layer
#: counts per stage, comma-separated (vLLM's ``VLLM_PP_LAYER_PARTITION``).
PP_LAYER_PARTITION_ENV = envs.PAGEDLLM_PP_LAYER_PARTITION.name


def pp_layer_partition(num_layers: int, pp_size: int, partition: str | None = None) -> list[int]:
    """Decoder layers per pipeline stage, stage 0 first.

    The even split gives each stage ``num_layers // pp_size`` layers and one more to each of
    the ``num_layers % pp_size`` stages just before the last (which also holds the final
    norm and LM head), as vLLM's ``get_pp_indices``; ``partition`` ("a,b,...", e.g. from
    ``PAGEDLLM_PP_LAYER_PARTITION``) gives the counts instead.

    Raises:
        ValueError: more stages than layers, or a partition that is not ``pp_size`` positive
            integers summing to ``num_layers``.
    """
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size {pp_size} exceeds the model's num_hidden_layers {num_layers}: "
            f"every stage needs at least one layer."
        )
    if partition:
        try:
            counts = [int(part) for part in partition.split(",")]
        except ValueError:
            counts = []
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"{PP_LAYER_PARTITION_ENV}={partition!r} must be {pp_size} positive layer counts "
                f"(one per pipeline stage) summing to num_hidden_layers {num_layers}."
            )
        return counts
    counts = [num_layers // pp_size] * pp_size
    for stage in range(pp_size - 1 - num_layers % pp_size, pp_size - 1):
        counts[stage] += 1
    return counts


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers ``[start, end)`` held by pipeline stage ``pp_rank`` (``pp_layer_partition``
    with ``PAGEDLLM_PP_LAYER_PARTITION`` when set).

    Raises:
        ValueError: as ``pp_layer_partition``.
    """
    counts = pp_layer_partition(num_layers, pp_size, envs.PAGEDLLM_PP_LAYER_PARTITION.get())
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]
