"""C++ CPU kernels, compiled on first use, once per instruction-set level.

``paged_attention.cpp`` (and the cache writes), ``elementwise.cpp`` (RMSNorm, SwiGLU, rotary embedding),
``sampling.cpp`` (greedy argmax), ``packed_linear.cpp`` (few-row matmul on oneDNN-packed
bf16 weights: vdpbf16ps, or AMX tiles where the CPU and OS allow them), ``linear_w16.cpp`` (matmul on 16-bit weights widened to float32, for CPUs
without native bf16, and on int8 weights with per-output scales) and ``linear_grouped.cpp``
(matmul on 4- and 8-bit weights with per-group scales and zero points; with ``int8_dot.h``'s
integer dot products on int8 activations), ``linear_dequant.cpp`` (the same weights for many
rows: tiles dequantized into a bf16 / float32 GEMM) and ``lora.cpp``
(the multi-LoRA shrink / expand of one linear layer), beside this file, are built with ``torch.utils.cpp_extension.load`` the first
time a kernel is asked for — never at import — and cached in torch's extensions directory
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``).

Runtime ISA dispatch: the level is chosen once per process, from the CPU's features or the
``PAGEDLLM_CPU_ISA`` override (``pagedllm.kernels.isa``), and logged. Each level is its own
build (``-mavx2 -mfma -mf16c`` for avx2, ``+ -mavx512f/bw/vl/dq`` for avx512,
``+ -mavx512bf16 -mavx512vnni`` for avx512_bf16, no ``-m`` flag for portable), whose operators live in a
namespace of their own, ``torch.ops.pagedllm_cpu_<level>``; the sources pick their vector path
from the compiler's feature macros. A build is therefore correct on any CPU of its level,
whichever machine filled the cache. Tests load several levels side by side (``using_isa``).
The extension name carries ``_KERNEL_VERSION``, the level and a hash of the sources and
their folder, the compiler flags and torch's version, so an edited source builds afresh.

If a level cannot be built (no C++ compiler, no ``ninja``, a compiler without the
instruction set), the next lower one is tried; if none can, or
``PAGEDLLM_DISABLE_CPU_KERNELS=1`` is set, ``is_available()`` returns False — with one
warning giving the reason — and callers use their portable PyTorch path. The variable is
read once per process, at the first ``is_available()`` (every kernel call asks it, so it
must not read the environment each time); ``reread_env()`` reads it again.

Processes that build at the same time (an engine core and a test, say) are serialised by a
``flock`` on the build directory, released by the OS even if its holder is killed; torch's
own lock file, which a killed build leaves behind and which would make every later load wait
forever, is removed under it.

Common flags: ``-O3 -fopenmp`` (OpenMP makes ``at::parallel_for`` use ATen's thread pool;
without it the kernel runs on one thread).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import torch

from pagedllm.kernels import isa as isa_mod

logger = logging.getLogger(__name__)

DISABLE_ENV = "PAGEDLLM_DISABLE_CPU_KERNELS"
_KERNEL_VERSION = 6
_DIR = Path(__file__).parent
_SOURCES = [_DIR / name for name in ("build_info.cpp", "paged_attention.cpp", "paged_attention_portable.cpp", "paged_attention_vec.cpp", "kv_cache_write.cpp", "elementwise.cpp", "sampling.cpp", "packed_linear.cpp", "linear_w16.cpp", "linear_grouped.cpp", "linear_dequant.cpp", "lora.cpp")]

_X86 = platform.machine().lower() in ("x86_64", "amd64")
_AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
_AVX512_FLAGS = [*_AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
_ISA_FLAGS = {
    "portable": [],
    "avx2": _AVX2_FLAGS,
    "avx512": _AVX512_FLAGS,
    "avx512_bf16": [*_AVX512_FLAGS, "-mavx512bf16", "-mavx512vnni"],
}

#: Seconds a first build is announced to take when this machine has not built one yet
#: (81 s measured on 2 busy cores); later announcements use the previous build's time,
#: kept in ``_BUILD_TIME_FILE`` in torch's extensions directory.
_DEFAULT_BUILD_ESTIMATE_S = 80
_BUILD_TIME_FILE = "pagedllm_cpu_kernels_build_seconds"

_lock = threading.Lock()
_builds: dict[str, str | None] = {}  # level -> None (loaded) or why it could not be built
_active: str | None = None  # the level whose operators the functions below call
_error: str | None = None  # why no level could be loaded, once a load was tried
_disabled: bool | None = None  # DISABLE_ENV as last read (None: not yet)
_disabled_logged = False


def _disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def reread_env() -> None:
    """Have the next ``is_available()`` read ``PAGEDLLM_DISABLE_CPU_KERNELS`` again (it is
    read once per process otherwise): for tests that set or clear it at run time. Builds
    already loaded stay loaded."""
    global _disabled, _disabled_logged
    _disabled = None
    _disabled_logged = False


def _build_flags(level: str) -> tuple[list[str], list[str]]:
    # -fopenmp makes at::parallel_for use ATen's OpenMP pool (without it, it runs serially).
    # The extension's libgomp.so.1 dependency resolves to the one torch already loaded (same
    # soname), so there is one OpenMP runtime in the process. -fvisibility-inlines-hidden keeps
    # each build's copies of inline header functions (compiled for its level) to itself.
    cflags = ["-O3", "-fopenmp", "-fvisibility-inlines-hidden", f"-DPAGEDLLM_OPS=pagedllm_cpu_{level}"]
    if _X86:
        cflags += _ISA_FLAGS[level]
    return cflags, ["-fopenmp"]


def _extension_name(level: str, cflags: list[str]) -> str:
    h = hashlib.sha256()
    for source in sorted(_DIR.glob("*.[ch]*")):
        if source.suffix in (".cpp", ".h"):
            h.update(source.name.encode())
            h.update(source.read_bytes())
    # The build directory's build.ninja names the sources by absolute path: two checkouts
    # of the same code sharing one name would rebuild each other's extension on every load.
    h.update(str(_DIR.resolve()).encode())
    h.update(" ".join(cflags).encode())
    h.update(torch.__version__.encode())
    return f"pagedllm_cpu_kernels_v{_KERNEL_VERSION}_{level}_{h.hexdigest()[:12]}"


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


def _built_library(name: str) -> str | None:
    """Path of the extension's shared library in torch's build directory (None when torch
    has no such helper)."""
    try:
        from torch.utils import cpp_extension

        return os.path.join(cpp_extension._get_build_directory(name, verbose=False), f"{name}.so")
    except Exception:  # noqa: BLE001 - a torch without the helper: no first-build message
        return None


def _build_estimate_s(library: str) -> int:
    """Seconds the previous build on this machine took (kept beside the builds), else
    ``_DEFAULT_BUILD_ESTIMATE_S``."""
    try:
        return max(1, round(float(Path(library).parent.parent.joinpath(_BUILD_TIME_FILE).read_text())))
    except (OSError, ValueError):
        return _DEFAULT_BUILD_ESTIMATE_S


def _ensure_built(level: str) -> bool:
    """Build or load ``level``'s extension once (call under ``_lock``); whether it is loaded.

    A build (not a load from the cache) is announced at INFO with its expected duration
    before it starts, and its duration is logged after.
    """
    if level not in _builds:
        cflags, ldflags = _build_flags(level)
        name = _extension_name(level, cflags)
        library = _built_library(name)
        building = library is not None and not os.path.exists(library)
        if building:
            logger.info(
                "Building CPU kernels for %s (first start only, about %d s)...", level, _build_estimate_s(library)
            )
        start = time.perf_counter()
        try:
            _load_locked(name, cflags, ldflags)
        except Exception as exc:  # noqa: BLE001 - any build failure means "try a lower level"
            _builds[level] = f"{level}: {type(exc).__name__}: {str(exc).strip()[-2000:]}"
        else:
            _builds[level] = None
            elapsed = time.perf_counter() - start
            if building:
                logger.info("Built CPU kernels for %s in %.1f s (cached in %s)", level, elapsed, os.path.dirname(library))
                with contextlib.suppress(OSError):
                    Path(library).parent.parent.joinpath(_BUILD_TIME_FILE).write_text(f"{elapsed:.1f}\n")
            else:
                logger.debug("Loaded CPU kernels %s in %.1f s", name, elapsed)
    return _builds[level] is None


def is_available() -> bool:
    """Whether the C++ CPU kernels can be used; builds/loads them on the first call, at the
    level ``pagedllm.kernels.isa.selected_isa()`` names (or the next lower one that builds),
    and logs the level with the CPU's own.

    Returns False (after logging one warning with the reason) when
    ``PAGEDLLM_DISABLE_CPU_KERNELS`` is set (as read by the first call, or the first after
    ``reread_env()``) or no level can be built or loaded. Once decided, a call costs two
    global reads: every kernel call asks it.

    Raises:
        ValueError: ``PAGEDLLM_CPU_ISA`` names an unknown level or one above this CPU's.
    """
    global _active, _error, _disabled, _disabled_logged
    if _active is not None and _disabled is False:
        return True
    if _disabled is None:
        _disabled = _disabled_by_env()
    if _disabled:
        if not _disabled_logged:
            _disabled_logged = True
            logger.info("pagedllm C++ CPU kernels disabled by %s: portable PyTorch code", DISABLE_ENV)
        return False
    if _active is not None:
        return True
    if _error is not None:
        return False
    with _lock:
        if _active is not None or _error is not None:
            return _active is not None
        selected = isa_mod.selected_isa()
        for level in reversed(isa_mod.LEVELS[: isa_mod.LEVELS.index(selected) + 1]):
            if _ensure_built(level):
                _active = level
                override = os.environ.get(isa_mod.ENV)
                logger.info(
                    "pagedllm CPU kernels: %s (this CPU supports up to %s%s)",
                    level,
                    isa_mod.detected_isa(),
                    f"; {isa_mod.ENV}={override}" if override else "",
                )
                return True
        _error = "; ".join(reason for reason in _builds.values() if reason)
        logger.warning(
            "pagedllm C++ CPU kernels unavailable, using the portable PyTorch code (slower). Reason: %s", _error
        )
    return False


def active_isa() -> str:
    """The instruction-set level the kernels run at (see ``is_available``).

    Raises:
        RuntimeError: if the kernels are unavailable.
    """
    _require()
    assert _active is not None
    return _active


@contextlib.contextmanager
def using_isa(level: str) -> Iterator[None]:
    """Run the kernels of ``level`` (building it if needed) inside the block, then return to
    the process's level. For tests and benchmarks that compare the paths one host supports;
    not thread-safe against kernels running elsewhere in the process.

    Raises:
        RuntimeError: if the kernels are unavailable, or ``level`` cannot be built.
        ValueError: if ``level`` is unknown or above this CPU's.
    """
    global _active
    if isa_mod.parse_override(level) is None:
        raise ValueError(f"no instruction-set level given: {level!r}")
    _require()
    with _lock:
        if not _ensure_built(level):
            raise RuntimeError(f"pagedllm CPU kernels for {level} cannot be built: {_builds[level]}")
        previous, _active = _active, level
    try:
        yield
    finally:
        _active = previous


def _ops():
    return getattr(torch.ops, f"pagedllm_cpu_{_active}")


def build_info() -> str:
    """The instruction-set level the running build was compiled for, and OpenMP, e.g.
    ``"avx2,openmp"``.

    Raises:
        RuntimeError: if the kernels are unavailable.
    """
    _require()
    return _ops().build_info()


def _require() -> None:
    if not is_available():
        reason = "disabled by " + DISABLE_ENV if _disabled else _error
        raise RuntimeError(f"pagedllm C++ CPU kernels unavailable: {reason}")


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    portable: bool = False,
    per_token: bool = False,
) -> None:
    """Decode attention (one query per request) over the paged KV cache, into ``out``.

    Args:
        out: [B, Hq, D], the dtype of ``query``; written in place.
        query: [B, Hq, D]; float32, bfloat16 or float16 (accumulation is float32).
        key_cache, value_cache: [num_blocks, block_size, Hkv, D] (``kv_cache[0]``,
            ``kv_cache[1]`` of a layer's cache); head_dim contiguous. Hq % Hkv == 0. The
            query's dtype, or float8_e4m3fn / float8_e5m2 (an FP8 cache, widened exactly).
        block_table: [B, max_blocks] int64 (other integer dtypes are converted).
        seq_lens: [B] int64 (likewise), context length including the new token; cache
            positions at or beyond it are not read.
        scale: softmax scale.
        k_scale, v_scale: an FP8 cache's scales: keys are ``k_scale * key_cache``, values
            ``v_scale * value_cache``.
        portable: run the kernel's portable loops whatever the build (for tests).
        per_token: compute every query token alone, never several consecutive tokens of one
            context together: a token's output is then the same whatever else is in the call
            (``--batch-invariant``).

    Raises:
        RuntimeError: if the kernels are unavailable, or on bad shapes, dtypes, block ids or
            lengths.
    """
    _require()
    ops = _ops()
    if portable:
        op = ops.paged_decode_attention_portable
    else:
        op = ops.paged_decode_attention_per_token if per_token else ops.paged_decode_attention
    op(out, query, key_cache, value_cache, block_table.long(), seq_lens.long(), float(scale), float(k_scale),
       float(v_scale))


def write_kv_cache(
    key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Store each token's key and value in its slot (``pagedllm.attention.paged_kv_cache``'s
    ``write_to_kv_cache`` in one call, byte for byte the same).

    Args:
        key_cache, value_cache: [num_blocks, block_size, Hkv, D] (``kv_cache[0]``,
            ``kv_cache[1]``), head_dim contiguous: the key's dtype, or float8_e4m3fn /
            float8_e5m2 (then stored as ``key / k_scale``, rounded to nearest even,
            saturated at the format's largest value).
        key, value: [num_tokens, Hkv, D]; float32, bfloat16 or float16.
        slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset.
        k_scale, v_scale: FP8 scales; unused for a cache of the key's dtype.

    Raises:
        RuntimeError: unavailable kernels, bad shapes or dtypes, or a slot out of range.
    """
    _require()
    _ops().write_kv_cache(key_cache, value_cache, key, value, slot_mapping.long(), float(k_scale), float(v_scale))


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
    _ops().rms_norm(out, x3, weight, float(eps))
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place, for x and residual [T, D]: ``residual = to_dtype(x + residual)``, then
    ``x = rms_norm(residual)`` (see ``rms_norm``).

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    _require()
    _ops().fused_add_rms_norm(x, residual, weight, float(eps))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU of x [T, 2d] = [gate | up]: ``to_dtype(to_dtype(silu(gate)) * up)`` -> [T, d].

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    _require()
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    _ops().silu_and_mul(out, x)
    return out


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate query [T, Hq, D] and key [T, Hk, D] in place (neox layout, HF's
    ``apply_rotary_pos_emb`` with its bf16 roundings) by cos / sin [T, D] of x's dtype.

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    _require()
    _ops().rotary_embedding(query, key, cos, sin)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` for logits [B, V] (float32 / bfloat16 / float16, V
    contiguous): first index of each row's maximum (or of its first NaN), [B] int64.

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    _require()
    return _ops().argmax_rows(logits)


def has_packed_linear() -> bool:
    """Whether ``packed_linear`` can run here: the kernels available at the avx512_bf16 level."""
    return is_available() and _ops().build_info().startswith("avx512_bf16")


def has_amx() -> bool:
    """Whether ``packed_linear(..., amx=True)`` can run here: ``has_packed_linear()``, and the
    CPU has AMX-TILE and AMX-BF16 and the OS grants their state (Linux 5.16+; asked once)."""
    return has_packed_linear() and bool(_ops().has_amx())


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int = 64, amx: bool = False
) -> torch.Tensor:
    """``x W^T + b`` for a few rows: x [M, K] bfloat16 (last dimension contiguous), weight
    [N, K] bfloat16 packed by ``torch.ops.mkldnn._reorder_linear_weight`` into oneDNN's
    ``block_n``-output x 32-input blocks (64 on AVX512-BF16, 32 where oneDNN uses AMX;
    ``linear.py`` checks the layout per shape), bias [N] or None -> [M, N] bfloat16, float32
    accumulation. ``amx``: with AMX tiles (block_n 32, M <= 16, ``has_amx()``), whose sums
    are oneDNN's own; else with vdpbf16ps. Faster than oneDNN's own matmul from 1 to 16 rows
    (see ``packed_linear.cpp``).

    Raises:
        RuntimeError: unavailable kernels, a build without AVX512-BF16, or bad shapes /
            dtypes / layout / block_n, or ``amx`` where it cannot run.
    """
    _require()
    return _ops().packed_linear(x, weight, bias, block_n, amx)


def pack_w16(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] bfloat16 / float16 re-laid out for ``linear_w16``: a new tensor
    [ceil(N / 16), K, 16] of the same dtype, blocks of 16 outputs with each input's 16 weights
    together, the last block padded with zeros (see ``linear_w16.cpp``).

    Raises:
        RuntimeError: unavailable kernels, or a bad shape / dtype.
    """
    _require()
    return _ops().pack_w16(weight)


def linear_w16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x W^T + b`` with 16-bit weights widened to float32 (float32 products and sums): x
    [M, K] float32 / bfloat16 / float16 (last dimension contiguous), weight ``pack_w16``'s
    output for W [n, K], bias [n] or None -> [M, n] in x's dtype. Up to 16 rows a
    weight-streaming kernel (AVX2 and up); more rows, torch's float32 GEMM on chunks of
    widened weights (see ``linear_w16.cpp``).

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    _require()
    return _ops().linear_w16(x, weight, bias, n)


def pack_w32(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] float32 in ``pack_w16``'s layout ([ceil(N / 16), K, 16], float32),
    for ``linear_rows``.

    Raises:
        RuntimeError: unavailable kernels, or a bad shape / dtype.
    """
    _require()
    return _ops().pack_w32(weight)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x W^T + b`` computed row by row in one fixed order (``--batch-invariant``): each
    row of the output is the same float32 sums whatever the number of rows and the other
    rows' values. x [M, K] float32 / bfloat16 / float16, weight ``pack_w16``'s or
    ``pack_w32``'s output for W [n, K], bias [n] or None -> [M, n] in x's dtype (see
    ``linear_w16.cpp``).

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    _require()
    return _ops().linear_rows(x, weight, bias, n)


def pack_w8(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] int8 re-laid out for ``linear_w8``: [ceil(N / 16), K, 16] int8, the
    layout of ``pack_w16`` (see ``linear_w16.cpp``).

    Raises:
        RuntimeError: unavailable kernels, or a bad shape / dtype.
    """
    _require()
    return _ops().pack_w8(weight)


def linear_w8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """``(x Q^T) * scale + b`` for int8 weights Q [n, K] with one float32 scale per output
    (W = scale[:, None] * Q): x [M, K] float32 / bfloat16 / float16, weight ``pack_w8``'s
    output, scale [n] float32 contiguous, bias [n] or None -> [M, n] in x's dtype; float32
    products and sums. M <= ``FEW_ROWS_MAX``: a weight-streaming kernel (AVX2 and up) reading
    one byte per weight; on the portable level torch's float32 GEMM on chunks of widened
    weights. More rows go to ``linear_dequant``.

    Raises:
        RuntimeError: unavailable kernels, more than ``FEW_ROWS_MAX`` rows, or bad shapes /
            dtypes.
    """
    _require()
    return _ops().linear_w8(x, weight, scale, bias, n)


def linear_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """``linear_w8`` for float8 e4m3 weights F [n, K] (W = scale[:, None] * F): weight is F's
    bytes packed by ``pack_w8`` and viewed back as ``torch.float8_e4m3fn``; widened to float32
    exactly inside the kernel (see ``linear_w16.cpp``); at most ``FEW_ROWS_MAX`` rows.

    Raises:
        RuntimeError: unavailable kernels, more than ``FEW_ROWS_MAX`` rows, or bad shapes /
            dtypes.
    """
    _require()
    return _ops().linear_fp8(x, weight, scale, bias, n)


def pack_w4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] uint8 of 4-bit values (0-15, K even) re-laid out for ``linear_w4``:
    [ceil(N / 16), K / 2, 16] uint8, blocks of 16 outputs with inputs 2i and 2i + 1 in the
    low and high nibble of one byte (see ``linear_grouped.cpp``).

    Raises:
        RuntimeError: unavailable kernels, or a bad shape / dtype.
    """
    _require()
    return _ops().pack_w4(weight)


def pack_groups(values: torch.Tensor) -> torch.Tensor:
    """Per-group scales or zero points [N, G] re-laid out as the weight blocks are, for
    ``linear_w4`` / ``linear_w8g`` / ``linear_dequant``: [ceil(N / 16), G, 16], the 16 outputs
    of a block side by side per group (zero padded), so the decode kernels load a group's 16
    values at once instead of gathering them from 16 rows (see ``group_scales.h``). Pure
    PyTorch; keeps the dtype."""
    n, groups = values.shape
    blocks = -(-n // 16)
    padded = torch.nn.functional.pad(values, (0, 0, 0, blocks * 16 - n))
    return padded.view(blocks, 16, groups).transpose(1, 2).contiguous()


def linear_w4(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    int8_activations: bool = False,
) -> torch.Tensor:
    """``x W^T + b`` for 4-bit weights W[n, k] = scale[n, g] * (Q[n, k] - zero[n, g]), g = k //
    group_size: x [M, K] float32 / bfloat16 / float16, weight ``pack_w4``'s output for Q [n, K],
    scale [n, K / group_size] float32 or float16 and zero float32 of the same shape, or None for
    symmetric weights (zero 8 everywhere: read nothing), contiguous (group_size even), or both
    ``pack_groups``' blocked layout (faster at few rows), bias [n] or None -> [M, n] in x's
    dtype; float32 products and sums. M <= ``FEW_ROWS_MAX``: a
    weight-streaming kernel (AVX2 and up) reading half a byte per weight; on the portable
    level torch's float32 GEMM on chunks of dequantized weights (see ``linear_grouped.cpp``).
    More rows go to ``linear_dequant``.

    ``int8_activations``: when group_size is a multiple of 32, x is first
    quantized to int8 per block of 32 inputs (symmetric, float32 scale max|x| / 127, round half
    to even; llama.cpp's Q8_0 activations) and multiplied with exact int32 dot products
    (AVX512-VNNI, AVX-512BW / AVX2 vpmaddubsw, or plain loops; see ``int8_dot.h``): faster, and
    exactly ``x_q W^T`` up to float32 summation, x_q the dequantized int8 x. Otherwise ignored.

    Raises:
        RuntimeError: unavailable kernels, more than ``FEW_ROWS_MAX`` rows, or bad shapes /
            dtypes.
    """
    _require()
    return _ops().linear_w4(x, weight, scale, zero, bias, n, int8_activations)


def linear_w8g(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    int8_activations: bool = False,
) -> torch.Tensor:
    """``linear_w4`` for 8-bit unsigned weights (W = scale * (Q - zero) per group, Q 0-255):
    weight is Q [n, K] uint8 in ``pack_w8``'s layout ([ceil(n / 16), K, 16] uint8; pack its
    bytes viewed as int8), scale and zero as ``linear_w4``'s (zero None: 128 everywhere; see
    ``linear_grouped.cpp``); at most ``FEW_ROWS_MAX`` rows.

    Raises:
        RuntimeError: unavailable kernels, more than ``FEW_ROWS_MAX`` rows, or bad shapes /
            dtypes.
    """
    _require()
    return _ops().linear_w8g(x, weight, scale, zero, bias, n, int8_activations)


#: Rows of x the few-row kernels (``linear_w8``, ``linear_fp8``, ``linear_w8g``, ``linear_w4``)
#: take at most (``kStreamRows`` in ``weight_blocks.h``); ``linear_w16`` takes any number.
FEW_ROWS_MAX = 16

#: Weight bits -> rows of x from which the quantized layers call ``linear_dequant`` instead of
#: the few-row kernels (``linear_w8``, ``linear_w8g`` and ``linear_fp8`` for 8 bits,
#: ``linear_w4`` for 4); at most ``FEW_ROWS_MAX + 1``. Measured on the 0.5B shape's layers
#: against the float-activation few-row kernels (``benchmarks/quantized_prefill.py --cpu-time
#: --rows 8 16 32``, AVX512-BF16 + AMX, one thread): at 16 rows the int8 kernel and
#: linear_dequant were within 10% and the int4 kernel 1.3-1.8x slower; at 32 rows both 3-4x
#: slower. The grouped kernels' int8-activation path (up to 16 rows, 2-3x faster than their
#: float path) moves the 4-bit crossing to 17 too.
DEQUANT_GEMM_MIN_ROWS = {8: 17, 4: 17}


def linear_dequant(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    bits: int,
    tile_cols: int = 0,
) -> torch.Tensor:
    """``x W^T + b`` for many rows of x against 8- or 4-bit weights, dequantized tile by tile
    into a GEMM of bfloat16 (x bfloat16 on an AVX512-BF16 build: oneDNN, with AMX where
    present) or float32 (elsewhere), never a whole dequantized layer (see
    ``linear_dequant.cpp``). x [M, K] float32 / bfloat16 / float16 (last dimension
    contiguous), bias [n] or None -> [M, n] in x's dtype. The weights, as the few-row kernels
    take them:

    - ``linear_w8``'s: weight int8 (``pack_w8``), scale [n], zero None, bits 8;
    - ``linear_fp8``'s: weight float8_e4m3fn in ``pack_w8``'s layout, scale [n], zero None, bits 8;
    - ``linear_w8g``'s: weight uint8 in ``pack_w8``'s layout, scale / zero [n, G], bits 8;
    - ``linear_w4``'s: weight uint8 (``pack_w4``), scale / zero [n, G] (even groups), bits 4
      (for both: scale float32 or float16, zero float32 or None for 2^(bits - 1), [n, G] or
      ``pack_groups``' [ceil(n / 16), G, 16]).

    ``tile_cols``: outputs per tile, a multiple of 16 (0: about 512 KB of dequantized
    weights per tile, the tiles spread evenly over the threads); for benchmarks.

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    _require()
    return _ops().linear_dequant(x, weight, scale, zero, bias, n, bits, tile_cols)


def lora_sgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              groups: torch.Tensor, output_sizes: list[int]) -> None:
    """Add each token's LoRA update to ``y`` in place, the whole mixed batch in one call
    (see ``lora.cpp``): y [T, N] and x [T, K] of one dtype (float32 / bfloat16 / float16),
    lora_a [S, K, J * R] and lora_b [S, R, N] both float32 or both x's dtype, groups [G, 3] int64 rows (slot,
    start, end), output_sizes the J slice widths summing to N.

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes / groups.
    """
    _require()
    _ops().lora_sgmv(y, x, lora_a, lora_b, groups, output_sizes)
