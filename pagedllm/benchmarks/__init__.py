"""``pagedllm bench``: throughput, latency, serve (HTTP load generator) and roofline.

Each benchmark module has ``add_cli_args(parser)`` and ``main(args) -> int``; ``cli.py``
wires them under ``pagedllm bench``. Small helpers shared by the modules live here; they
import nothing heavy (torch is imported only by the benchmarks that run a model).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from pagedllm import envs


def machine_info() -> dict[str, Any]:
    """CPU model, core count, the CPU's instruction-set level and the one the kernels were
    asked to run at (``PAGEDLLM_CPU_ISA``), and library versions, recorded with every result."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from pagedllm.kernels import isa

    info["cpu_isa"] = isa.detected_isa()
    info["cpu_isa_override"] = envs.PAGEDLLM_CPU_ISA.get()
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def summarize(values_ms: Iterable[float], percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """mean, median, std and the given percentiles of a list of numbers (0 for an empty list)."""
    arr = np.asarray(list(values_ms), dtype=np.float64)
    out: dict[str, float] = {}
    empty = arr.size == 0
    out["mean"] = 0.0 if empty else float(arr.mean())
    out["median"] = 0.0 if empty else float(np.median(arr))
    out["std"] = 0.0 if empty else float(arr.std())
    for p in percentiles:
        out[f"p{percentile_label(p)}"] = 0.0 if empty else float(np.percentile(arr, p))
    return out


def percentile_label(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9" (vLLM's key style: ``p99_ttft_ms``)."""
    return str(int(p)) if float(p).is_integer() else str(p)


def write_json(path: Optional[str], result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` (if given), creating parent folders."""
    if not path:
        return
    out = Path(path)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")


def set_num_threads(num_threads: Optional[int]) -> None:
    """``torch.set_num_threads`` when asked (default: torch's own choice)."""
    if num_threads:
        import torch

        torch.set_num_threads(num_threads)
