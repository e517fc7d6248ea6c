"""The model-parallel communication's cost in an offline benchmark (``pagedllm bench latency``
/ ``throughput`` with ``--tensor-parallel-size`` or ``--pipeline-parallel-size`` above 1):
tensor-parallel collectives, and the hidden states rank 0 sends to the next pipeline stage.

Every worker counts its collectives (``pagedllm.distributed.parallel_state.get_comm_stats``:
calls, bytes, seconds inside the call, waiting for the slowest rank included) and its steps.
``reset`` zeroes them after the warm-up; ``collect`` reads them back through the executor.
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


def collect(llm: Any, elapsed_s: float) -> Optional[dict[str, Any]]:
    """Per operation, rank 0's counts since ``reset``: ``calls``, ``bytes_per_call``,
    ``ms_total``, ``us_per_call``, ``ms_per_step`` and ``share_of_elapsed`` (of
    ``elapsed_s``, the benchmark's measured time); with ``steps``. None with one worker."""
    if not _model_parallel(llm):
        return None
    rank0 = _executor(llm).collective_rpc("get_comm_stats")[0]
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
    return {"steps": steps, "ops": ops}


def print_stats(stats: Optional[dict[str, Any]]) -> None:
    """One line per collective (nothing for None)."""
    if not stats:
        return
    for op, s in stats["ops"].items():
        print(f"Model-parallel {op} (rank 0): {s['calls']} calls over {stats['steps']} steps, "
              f"{s['bytes_per_call'] / 1024:.1f} KiB/call, {s['us_per_call']:.1f} us/call, "
              f"{s['ms_per_step']:.2f} ms/step, {100 * s['share_of_elapsed']:.1f}% of the measured time")
