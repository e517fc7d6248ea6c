"""C++ CPU kernels, compiled on first use.

``paged_attention.cpp``, ``elementwise.cpp`` (RMSNorm, SwiGLU, rotary embedding) and
``sampling.cpp`` (greedy argmax) and ``packed_linear.cpp`` (few-row matmul on oneDNN-packed
bf16 weights), beside this file, are built with ``torch.utils.cpp_extension.load``
the first time a kernel is asked for — never at import — and cached in torch's extensions
directory (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``). The extension
name carries ``_KERNEL_VERSION`` and a hash of the sources and their folder, the compiler
flags and the CPU's
feature flags, so an edited source, or a cache shared with a different CPU (the build uses
``-march=native``), builds afresh instead of reusing a stale binary.

If the build cannot happen (no C++ compiler, no ``ninja``, a compile error) or
``PAGEDLLM_DISABLE_CPU_KERNELS=1`` is set, ``is_available()`` returns False — with one
warning giving the reason — and callers use their portable PyTorch path.

Processes that build at the same time (an engine core and a test, say) are serialised by a
``flock`` on the build directory, released by the OS even if its holder is killed; torch's
own lock file, which a killed build leaves behind and which would make every later load wait
forever, is removed under it.

The kernels are registered as torch operators, ``torch.ops.pagedllm_cpu.*``. Build flags:
``-O3 -fopenmp -march=native`` (OpenMP makes ``at::parallel_for`` use ATen's thread pool;
without it the kernel runs on one thread).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "PAGEDLLM_DISABLE_CPU_KERNELS"
_KERNEL_VERSION = 2
_SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention.cpp", "elementwise.cpp", "sampling.cpp", "packed_linear.cpp")]

_lock = threading.Lock()
_loaded = False
_error: str | None = None  # why the kernels are unavailable, once a load was tried


def _disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _cpu_signature() -> str:
    """The CPU's feature flags (Linux) or model name: part of the build's identity."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _build_flags(native: bool) -> tuple[list[str], list[str]]:
    # -fopenmp makes at::parallel_for use ATen's OpenMP pool (without it, it runs serially).
    # The extension's libgomp.so.1 dependency resolves to the one torch already loaded (same
    # soname), so there is one OpenMP runtime in the process.
    cflags = ["-O3", "-fopenmp"]
    if native:
        cflags.append("-march=native")
    return cflags, ["-fopenmp"]


def _extension_name(cflags: list[str]) -> str:
    h = hashlib.sha256()
    for source in _SOURCES:
        h.update(source.read_bytes())
    # The build directory's build.ninja names the sources by absolute path: two checkouts
    # of the same code sharing one name would rebuild each other's extension on every load.
    h.update(str(_SOURCES[0].parent.resolve()).encode())
    h.update(" ".join(cflags).encode())
    h.update(_cpu_signature().encode())
    h.update(torch.__version__.encode())
    return f"pagedllm_cpu_kernels_v{_KERNEL_VERSION}_{h.hexdigest()[:12]}"


def _ensure_ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; the pip ``ninja`` package's binary sits in the venv's
    bin directory, which is not on PATH when the venv's python is run without activation."""
    if shutil.which("ninja"):
        return
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # type: ignore[import-not-found]

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    for d in dirs:
        if shutil.which("ninja", path=d):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return


def _load_locked(name: str, cflags: list[str], ldflags: list[str]) -> None:
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()

    def build() -> None:
        cpp_extension.load(
            name=name,
            sources=[str(source) for source in _SOURCES],
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            is_python_module=False,
            verbose=False,
        )

    try:
        import fcntl

        build_dir = cpp_extension._get_build_directory(name, verbose=False)
    except Exception:  # noqa: BLE001 - no flock (Windows) or a torch without the helper
        build()
        return
    with open(os.path.join(build_dir, "pagedllm.flock"), "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            # Whoever held torch's baton held this flock too: a baton file seen now is stale.
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                logger.warning("Removing stale torch extension lock %s", stale)
                os.remove(stale)
            build()
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _build_and_load() -> None:
    errors = []
    # -march=native first (AVX-512 and AVX512-BF16 paths on CPUs that have them); if the
    # compiler rejects it, a portable build.
    for native in (True, False):
        cflags, ldflags = _build_flags(native)
        name = _extension_name(cflags)
        start = time.perf_counter()
        try:
            _load_locked(name, cflags, ldflags)
        except Exception as exc:  # noqa: BLE001 - any build failure means "use the fallback"
            errors.append(f"{type(exc).__name__}: {str(exc).strip()[-2000:]}")
            if "Ninja is required" in str(exc):
                break
            continue
        elapsed = time.perf_counter() - start
        logger.log(
            logging.INFO if elapsed > 2.0 else logging.DEBUG,  # built now vs loaded from cache
            "pagedllm CPU kernels %s ready in %.1fs (%s)",
            name,
            elapsed,
            torch.ops.pagedllm_cpu.build_info(),
        )
        return
    raise RuntimeError("; ".join(errors))


def is_available() -> bool:
    """Whether the C++ CPU kernels can be used; builds/loads them on the first call.

    Returns False (after logging one warning with the reason) when
    ``PAGEDLLM_DISABLE_CPU_KERNELS`` is set or the extension cannot be built or loaded.
    """
    global _loaded, _error
    if _disabled_by_env():
        return False
    if _loaded:
        return True
    if _error is not None:
        return False
    with _lock:
        if _loaded or _error is not None:
            return _loaded
        try:
            _build_and_load()
            _loaded = True
        except Exception as exc:  # noqa: BLE001
            _error = str(exc)
            logger.warning(
                "pagedllm C++ CPU kernels unavailable, using the portable PyTorch attention "
                "(slower). Reason: %s",
                _error,
            )
    return _loaded


def build_info() -> str:
    """The vector path of the loaded build, e.g. ``"avx512+bf16,openmp"``.

    Raises:
        RuntimeError: if the kernels are unavailable.
    """
    _require()
    return torch.ops.pagedllm_cpu.build_info()


def _require() -> None:
    if not is_available():
        reason = "disabled by " + DISABLE_ENV if _disabled_by_env() else _error
        raise RuntimeError(f"pagedllm C++ CPU kernels unavailable: {reason}")


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    portable: bool = False,
) -> None:
    """Decode attention (one query per request) over the paged KV cache, into ``out``.

    Args:
        out: [B, Hq, D], the dtype of ``query``; written in place.
        query: [B, Hq, D]; float32, bfloat16 or float16 (accumulation is float32).
        key_cache, value_cache: [num_blocks, block_size, Hkv, D] (``kv_cache[0]``,
            ``kv_cache[1]`` of a layer's cache); head_dim contiguous. Hq % Hkv == 0.
        block_table: [B, max_blocks] int64 (other integer dtypes are converted).
        seq_lens: [B] int64 (likewise), context length including the new token; cache
            positions at or beyond it are not read.
        scale: softmax scale.
        portable: run the kernel's portable loops whatever the build (for tests).

    Raises:
        RuntimeError: if the kernels are unavailable, or on bad shapes, dtypes, block ids or
            lengths.
    """
    _require()
    ops = torch.ops.pagedllm_cpu
    op = ops.paged_decode_attention_portable if portable else ops.paged_decode_attention
    op(out, query, key_cache, value_cache, block_table.long(), seq_lens.long(), float(scale))


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels can run on ``x``: a CPU tensor, and the kernels available."""
    return x.device.type == "cpu" and is_available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * to_dtype(x * rsqrt(mean(x^2) + eps))`` over the last dimension (HF's
    LlamaRMSNorm; float32 math), for x [T, D] or [T, H, D] with the last dimension
    contiguous (any outer strides). Returns a new contiguous tensor of x's shape.

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes (weight [D], x's dtype).
    """
    _require()
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    torch.ops.pagedllm_cpu.rms_norm(out, x3, weight, float(eps))
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place, for x and residual [T, D]: ``residual = to_dtype(x + residual)``, then
    ``x = rms_norm(residual)`` (see ``rms_norm``).

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    _require()
    torch.ops.pagedllm_cpu.fused_add_rms_norm(x, residual, weight, float(eps))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU of x [T, 2d] = [gate | up]: ``to_dtype(to_dtype(silu(gate)) * up)`` -> [T, d].

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    _require()
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    torch.ops.pagedllm_cpu.silu_and_mul(out, x)
    return out


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate query [T, Hq, D] and key [T, Hk, D] in place (neox layout, HF's
    ``apply_rotary_pos_emb`` with its bf16 roundings) by cos / sin [T, D] of x's dtype.

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    _require()
    torch.ops.pagedllm_cpu.rotary_embedding(query, key, cos, sin)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` for logits [B, V] (float32 / bfloat16 / float16, V
    contiguous): first index of each row's maximum (or of its first NaN), [B] int64.

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    _require()
    return torch.ops.pagedllm_cpu.argmax_rows(logits)


def has_packed_linear() -> bool:
    """Whether ``packed_linear`` can run here: the kernels available and built with
    AVX512-BF16."""
    return is_available() and "+bf16" in torch.ops.pagedllm_cpu.build_info()


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for a few rows: x [M, K] bfloat16 (last dimension contiguous), weight
    [N, K] bfloat16 packed by ``torch.ops.mkldnn._reorder_linear_weight`` into oneDNN's
    64-output x 32-input blocks (``linear.py`` checks the layout per shape), bias [N] or None
    -> [M, N] bfloat16, float32 accumulation. Faster than oneDNN's own matmul from 1 to 16
    rows (see ``packed_linear.cpp``).

    Raises:
        RuntimeError: unavailable kernels, a build without AVX512-BF16, or bad shapes /
            dtypes / layout.
    """
    _require()
    return torch.ops.pagedllm_cpu.packed_linear(x, weight, bias)
