"""The model-parallel communication's cost in an offline benchmark (``pagedllm bench latency``
/ ``throughput`` with ``--tensor-parallel-size`` or ``--pipeline-parallel-size`` above 1):
tensor-parallel collectives, and the hidden states rank 0 sends to the next pipeline stage.

Every worker counts its collectives (``pagedllm.distributed.parallel_state.get_comm_stats``:
calls, bytes, seconds inside the call, waiting for the slowest rank included) and its steps.
``reset`` zeroes them after the warm-up; ``collect`` reads them back through the executor,
with each rank's share of the measured time spent inside steps (a later pipeline stage's
includes waiting to receive the previous stage's hidden states) and, with pipeline
parallelism, the most steps (micro-batches) that were in flight at once.
"""

from __future__ import annotations

from typing import Any, Optional


def _executor(llm: Any) -> Any:
    return llm.llm_engine.engine_core.model_executor


def _model_parallel(llm: Any) -> bool:
    return llm.llm_engine.engine_core.config.parallel_config.world_size > 1


def reset(llm: Any) -> None:
    """Zero every worker's counts (a no-op with one worker)."""
    if _model_parallel(llm):
        _executor(llm).collective_rpc("get_comm_stats", kwargs={"reset": True})
        batch_queue = llm.llm_engine.engine_core.batch_queue
        if batch_queue is not None:
            batch_queue.max_batches_in_flight = 0


def collect(llm: Any, elapsed_s: float) -> Optional[dict[str, Any]]:
    """Per operation, rank 0's counts since ``reset``: ``calls``, ``bytes_per_call``,
    ``ms_total``, ``us_per_call``, ``ms_per_step`` and ``share_of_elapsed`` (of
    ``elapsed_s``, the benchmark's measured time); with ``steps``, ``busy_share`` (per rank,
    the share of ``elapsed_s`` inside steps) and ``max_batches_in_flight``. None with one
    worker."""
    if not _model_parallel(llm):
        return None
    ranks = _executor(llm).collective_rpc("get_comm_stats")
    rank0 = ranks[0]
    batch_queue = llm.llm_engine.engine_core.batch_queue
    steps = rank0["steps"]
    ops = {}
    for op, (calls, nbytes, seconds) in rank0["ops"].items():
        ops[op] = {
            "calls": calls,
            "bytes_per_call": nbytes / calls if calls else 0.0,
            "ms_total": seconds * 1e3,
            "us_per_call": seconds * 1e6 / calls if calls else 0.0,
            "ms_per_step": seconds * 1e3 / steps if steps else 0.0,
            "share_of_elapsed": seconds / elapsed_s if elapsed_s else 0.0,
        }
    return {
        "steps": steps, "ops": ops,
        "busy_share": [r["busy_s"] / elapsed_s if elapsed_s else 0.0 for r in ranks],
        "max_batches_in_flight": batch_queue.max_batches_in_flight if batch_queue is not None else 1,
    }


def print_stats(stats: Optional[dict[str, Any]]) -> None:
    """One line per collective, one for the ranks' busy shares (nothing for None)."""
    if not stats:
        return
    busy = ", ".join(f"rank {rank} {100 * share:.0f}%" for rank, share in enumerate(stats["busy_share"]))
    print(f"Workers inside steps (a later stage's waits for hidden states included): {busy} of the measured time; "
          f"at most {stats['max_batches_in_flight']} steps in flight")
    for op, s in stats["ops"].items():
        print(f"Model-parallel {op} (rank 0): {s['calls']} calls over {stats['steps']} steps, "
              f"{s['bytes_per_call'] / 1024:.1f} KiB/call, {s['us_per_call']:.1f} us/call, "
              f"{s['ms_per_step']:.2f} ms/step, {100 * s['share_of_elapsed']:.1f}% of the measured time")
