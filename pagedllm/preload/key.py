"""The cache key of preloaded weights: everything the loader's output depends on.

Fields (``cache_key``): the model folder, the size and modification time (ns) of each file
the loader reads (``config.json``, the weight files), the dtype, ``--quantization`` and
``--quantization-config``, the tensor- and pipeline-parallel rank and size, the CPU kernels'
ISA level and whether they are on (``PAGEDLLM_DISABLE_CPU_KERNELS`` unset: the loader lays
weights out for them, else keeps PyTorch's plain layout), and the pagedllm and torch versions.
``mismatch`` names the first field that differs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional

#: The fields of a key, in the order ``mismatch`` compares them.
KEY_FIELDS = (
    "model_path", "files", "dtype", "quantization", "quantization_config", "tensor_parallel_rank",
    "tensor_parallel_size", "pipeline_parallel_rank", "pipeline_parallel_size", "isa", "cpu_kernels",
    "pagedllm_version", "torch_version",
)  # fmt: skip


def _loaded_files(model_path: Path) -> list[Path]:
    """The files whose bytes reach the loader: config.json and the weights (or the .gguf file)."""
    if model_path.is_file():
        return [model_path]
    names = ("config.json", "model.safetensors.index.json")
    return sorted([model_path / n for n in names if (model_path / n).exists()] + list(model_path.glob("*.safetensors")))


def cache_key(model_config: Any) -> dict[str, Any]:
    """The key of the weights this process's loader makes of ``model_config`` (a ``ModelConfig``),
    as plain JSON values (see the module docstring)."""
    import torch

    from pagedllm import envs
    from pagedllm.distributed import get_pp_group, get_tp_group
    from pagedllm.kernels import isa
    from pagedllm.version import __version__

    model_path = Path(model_config.model_path).resolve()
    tp, pp = get_tp_group(), get_pp_group()
    return {
        "model_path": str(model_path),
        "files": {str(p.relative_to(model_path) if p != model_path else p.name): [p.stat().st_size, p.stat().st_mtime_ns]
                  for p in _loaded_files(model_path)},
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "quantization": model_config.quantization,
        "quantization_config": model_config.quantization_config,
        "tensor_parallel_rank": tp.rank_in_group,
        "tensor_parallel_size": tp.world_size,
        "pipeline_parallel_rank": pp.rank_in_group,
        "pipeline_parallel_size": pp.world_size,
        "isa": isa.selected_isa(),
        "cpu_kernels": not envs.PAGEDLLM_DISABLE_CPU_KERNELS.get(),
        "pagedllm_version": __version__,
        "torch_version": torch.__version__,
    }


def store_name(model_path: Any, tensor_parallel_rank: int = 0, pipeline_parallel_rank: int = 0) -> str:
    """The folder name of one rank's store of a model (a hash of its resolved path)."""
    digest = hashlib.sha256(str(Path(model_path).resolve()).encode()).hexdigest()[:16]
    return f"{digest}-tp{tensor_parallel_rank}-pp{pipeline_parallel_rank}"


def mismatch(stored: dict[str, Any], wanted: dict[str, Any]) -> Optional[str]:
    """None when the keys are equal, else "field (preloaded: X, this engine: Y)" for the first
    field that differs (a file: which one)."""
    for field in KEY_FIELDS:
        have, want = stored.get(field), wanted.get(field)
        if have == want:
            continue
        if field == "files" and isinstance(have, dict) and isinstance(want, dict):
            for name in sorted(set(have) | set(want)):
                if have.get(name) != want.get(name):
                    return (f"files: {name} (preloaded: size, mtime {have.get(name)}, this engine: "
                            f"{want.get(name)})")
        return f"{field} (preloaded: {have!r}, this engine: {want!r})"
    return None
