"""Compiling the C++ CPU kernels: one torch extension per instruction-set level.

``load(level)`` builds (or loads from torch's extensions directory, ``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``) the sources in ``_SOURCES`` with ``level``'s flags;
their operators then live in ``torch.ops.pagedllm_cpu_<level>``. The extension's name, hence
its build directory, is keyed by everything its ``build.ninja`` holds (``build_key``), so
two environments or checkouts never rebuild each other's objects. Concurrent builds are
serialised by a ``flock`` on the build directory. Every build is logged at INFO with its
reason before it starts and its duration after. A build that is up to date is loaded as it
is (``torch.ops.load_library``), without importing ``torch.utils.cpp_extension``, which
imports setuptools (0.1-0.2 s of every engine's start); its folder and key name the same
paths ``cpp_extension`` would (``_include_paths``, ``_compiler``, ``_build_directory``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

logger = logging.getLogger(__package__)  # the package's logger, as every kernels message

_KERNEL_VERSION = 7
_DIR = Path(__file__).parent
_SOURCES = [_DIR / name for name in ("build_info.cpp", "paged_attention.cpp", "paged_attention_portable.cpp", "paged_attention_vec.cpp", "kv_cache_write.cpp", "elementwise.cpp", "sampling.cpp", "packed_linear.cpp", "linear_w16.cpp", "linear_grouped.cpp", "linear_dequant.cpp", "lora.cpp", "mamba_decode.cpp", "gated_delta.cpp", "fused_moe.cpp")]

_X86 = platform.machine().lower() in ("x86_64", "amd64")
_AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
_AVX512_FLAGS = [*_AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
_ISA_FLAGS = {
    "portable": [],
    "avx2": _AVX2_FLAGS,
    "avx512": _AVX512_FLAGS,
    "avx512_bf16": [*_AVX512_FLAGS, "-mavx512bf16", "-mavx512vnni"],
}

#: Seconds a build is announced to take when this machine has not built one yet; later
#: announcements use the previous build of that level's time, kept in
#: ``_BUILD_TIME_FILE`` + ``_<level>`` beside the builds (levels differ: portable builds slowest).
_DEFAULT_BUILD_ESTIMATE_S = 80
_BUILD_TIME_FILE = "pagedllm_cpu_kernels_build_seconds"


def build_flags(level: str) -> tuple[list[str], list[str]]:
    """(compiler flags, linker flags) of ``level``'s build."""
    # -fopenmp makes at::parallel_for use ATen's OpenMP pool (without it, it runs serially).
    # The extension's libgomp.so.1 dependency resolves to the one torch already loaded (same
    # soname), so there is one OpenMP runtime in the process. -fvisibility-inlines-hidden keeps
    # each build's copies of inline header functions (compiled for its level) to itself.
    cflags = ["-O3", "-fopenmp", "-fvisibility-inlines-hidden", f"-DPAGEDLLM_OPS=pagedllm_cpu_{level}"]
    if _X86:
        cflags += _ISA_FLAGS[level]
    return cflags, ["-fopenmp"]


def build_key(
    cflags: Sequence[str],
    ldflags: Sequence[str],
    include_paths: Optional[Sequence[str]] = None,
    python: Optional[str] = None,
    compiler: Optional[str] = None,
) -> str:
    """12 hex digits hashing what goes into the build's ``build.ninja``: the sources' names
    and bytes (every ``.cpp`` / ``.h`` beside this file) and their folder, ``cflags``,
    ``ldflags``, torch's version and include paths, the python executable and the C++
    compiler (None: this process's)."""
    h = hashlib.sha256()
    for source in sorted(_DIR.glob("*.[ch]*")):
        if source.suffix in (".cpp", ".h"):
            h.update(source.name.encode())
            h.update(source.read_bytes())
    parts = [
        str(_DIR.resolve()),
        " ".join(cflags),
        " ".join(ldflags),
        torch.__version__,
        *(_include_paths() if include_paths is None else include_paths),
        sys.executable if python is None else python,
        _compiler() if compiler is None else compiler,
    ]
    for part in parts:
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:12]


def _include_paths() -> list[str]:
    """torch's C++ include folders, as ``cpp_extension.include_paths()`` lists them for a CPU
    extension."""
    include = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "include")
    return [include, os.path.join(include, "torch", "csrc", "api", "include")]


def _compiler() -> str:
    """The C++ compiler torch's build runs (``CXX``, else ``c++``: ``cpp_extension.get_cxx_compiler``),
    as a resolved path where it is on PATH."""
    name = os.environ.get("CXX", "cl" if sys.platform == "win32" else "c++")
    return shutil.which(name) or name


def _build_directory(name: str) -> str:
    """The folder ``cpp_extension`` builds the extension ``name`` in (its
    ``_get_build_directory``, which also creates it): under ``TORCH_EXTENSIONS_DIR``, else
    under torch's cache folder, in a ``py<version>_<accelerator>`` folder."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch import _appdirs

        if torch.version.hip is not None:
            accelerator = "rocm" + torch.version.hip.replace(".", "")
        elif torch.version.cuda is not None:
            accelerator = "cu" + torch.version.cuda.replace(".", "")
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions")),
                            f"{python}_{accelerator}")
    return os.path.join(root, name)


def extension_name(level: str, cflags: Sequence[str], ldflags: Sequence[str]) -> str:
    """``pagedllm_cpu_kernels_v<version>_<level>_<build_key>``."""
    return f"pagedllm_cpu_kernels_v{_KERNEL_VERSION}_{level}_{build_key(cflags, ldflags)}"


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
    """``cpp_extension.load`` of the extension ``name`` under a ``flock`` on its build
    directory; torch's own lock file, which a killed build leaves behind (and which would make
    every later load wait forever), is removed under it."""
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


def _built_library(name: str) -> str:
    """Path of the extension's shared library in torch's build directory."""
    return os.path.join(_build_directory(name), f"{name}.so")


def _load_built(library: str) -> bool:
    """Load ``library``, an up-to-date build, as ``cpp_extension.load`` would after finding
    nothing to rebuild (``torch.ops.load_library``), under a shared ``flock`` on its folder
    (a build there holds it exclusively, so this waits for one under way). False, with
    nothing loaded, where it is no longer up to date once the lock is held or cannot be
    loaded so: ``cpp_extension.load`` then builds or loads it, and reports any failure."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows)
        return False
    try:
        with open(os.path.join(os.path.dirname(library), "pagedllm.flock"), "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_SH)
            try:
                if _rebuild_reason(library) is not None:
                    return False
                torch.ops.load_library(library)
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)
    except (OSError, RuntimeError) as exc:
        logger.debug("Loading the cached CPU kernels %s failed (%s); loading through torch's build", library, exc)
        return False
    return True


def _build_time_file(library: str, level: str) -> Path:
    """Where the last build of ``level`` on this machine recorded its seconds (beside the builds)."""
    return Path(library).parent.parent / f"{_BUILD_TIME_FILE}_{level}"


def _build_estimate_s(library: str, level: str) -> int:
    """Seconds the previous build of ``level`` on this machine took, else
    ``_DEFAULT_BUILD_ESTIMATE_S``."""
    try:
        return max(1, round(float(_build_time_file(library, level).read_text())))
    except (OSError, ValueError):
        return _DEFAULT_BUILD_ESTIMATE_S


def _rebuild_reason(library: str) -> str | None:
    """Why loading ``library`` will compile: no such file, or a source newer than it (ninja
    rebuilds by modification time); None when it loads as it is."""
    if not os.path.exists(library):
        return "no cached build for this key"
    built = os.path.getmtime(library)
    if any(source.stat().st_mtime > built for source in _DIR.glob("*.[ch]*") if source.suffix in (".cpp", ".h")):
        return "sources changed since the cached build"
    return None


def load(level: str) -> str | None:
    """Build or load ``level``'s extension: None once its operators are registered, else why
    it could not be (the exception's type and message). Logs a build at INFO before (with its
    reason and expected duration) and after (with its duration)."""
    cflags, ldflags = build_flags(level)
    name = extension_name(level, cflags, ldflags)
    library = _built_library(name)
    reason = _rebuild_reason(library)
    if reason is not None:
        logger.info("Building CPU kernels for %s: %s (about %d s)...", level, reason, _build_estimate_s(library, level))
    start = time.perf_counter()
    try:
        if reason is not None or not _load_built(library):
            _load_locked(name, cflags, ldflags)
    except Exception as exc:  # noqa: BLE001 - any build failure means "try a lower level"
        return f"{level}: {type(exc).__name__}: {str(exc).strip()[-2000:]}"
    elapsed = time.perf_counter() - start
    if reason is not None:
        logger.info("Built CPU kernels for %s in %.1f s (cached in %s)", level, elapsed, os.path.dirname(library))
        with contextlib.suppress(OSError):
            _build_time_file(library, level).write_text(f"{elapsed:.1f}\n")
    else:
        logger.debug("Loaded CPU kernels %s in %.1f s", name, elapsed)
    return None
