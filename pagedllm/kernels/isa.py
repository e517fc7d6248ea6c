"""Which x86-64 vector instruction set the C++ CPU kernels target: detected once, overridable.

Levels, lowest first (each needs every CPU feature of the ones below it):

=============  ==========================================  =====================================
level          CPU features (``/proc/cpuinfo`` flag names)  kernels built with
=============  ==========================================  =====================================
portable       none (any x86-64, or another architecture)   plain loops, compiler's baseline ISA
avx2           avx2, fma, f16c                             8-lane float32, F16C, FMA
avx512         + avx512f, avx512bw, avx512vl, avx512dq     16-lane float32, masks
avx512_bf16    + avx512_bf16, avx512_vnni                  + vdpbf16ps / vcvtneps2bf16, vpdpbusd
=============  ==========================================  =====================================

AVX512-VNNI (int8 dot products) rides with the avx512_bf16 level: every CPU with AVX512-BF16
(Cooper Lake, Sapphire Rapids and later, Zen 4 and later) has it. A CPU with VNNI but no BF16
(Cascade Lake, Ice Lake) runs the avx512 level, whose int8 kernels use vpmaddubsw instead.

The features come from the kernel's view of CPUID (the ``flags`` line of ``/proc/cpuinfo``,
which Linux clears for instruction sets the OS does not enable); elsewhere the level is
``portable``.

``PAGEDLLM_CPU_ISA=<level>`` forces a lower level than the host's, so that one AVX-512 machine
can run every path below its own. It also caps the libraries beside the kernels at the same
level where the user has not set them (``pagedllm.env_override`` applies them before torch is
imported): oneDNN (``ONEDNN_MAX_CPU_ISA``), ATen's vectorised CPU kernels
(``ATEN_CPU_CAPABILITY``) and MKL (``MKL_ENABLE_INSTRUCTIONS``), so the whole process behaves
as on a CPU of that level. Asking for a level above the host's is an error: its instructions
would fault.

This module imports nothing heavy (no torch): ``env_override`` reads it at ``import pagedllm``.
"""

from __future__ import annotations

import functools
import platform

from pagedllm import envs

ENV = envs.PAGEDLLM_CPU_ISA.name
LEVELS = ("portable", "avx2", "avx512", "avx512_bf16")

_FEATURES = {
    "portable": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx512_bf16": frozenset(
        {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
    ),
}

# What each level means to the libraries torch runs on (their documented environment variables:
# oneDNN's "CPU Dispatcher Control", ATen's ATEN_CPU_CAPABILITY, MKL's "Instruction Set
# Specific Dispatching").
_LIBRARY_ENV = {
    "portable": {"ONEDNN_MAX_CPU_ISA": "SSE41", "ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx512_bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags Linux reports (``/proc/cpuinfo``), empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def detected_isa() -> str:
    """The highest level of ``LEVELS`` this CPU supports (``portable`` off x86-64)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "portable"
    flags = cpu_flags()
    return [level for level in LEVELS if _FEATURES[level] <= flags][-1]


def supported_isas() -> list[str]:
    """Every level this CPU can run, lowest first."""
    return list(LEVELS[: LEVELS.index(detected_isa()) + 1])


def parse_override(value: str | None) -> str | None:
    """The level named by a ``PAGEDLLM_CPU_ISA`` value (None when unset or empty).

    Raises:
        ValueError: for an unknown name, or a level this CPU does not support.
    """
    if value is None or not value.strip():
        return None
    level = value.strip().lower()
    if level not in LEVELS:
        raise ValueError(f"{ENV}={value!r} is not one of {', '.join(LEVELS)}")
    host = detected_isa()
    if LEVELS.index(level) > LEVELS.index(host):
        raise ValueError(f"{ENV}={value!r} asks for more than this CPU supports (it supports up to {host!r})")
    return level


def selected_isa() -> str:
    """The level the kernels run at: ``PAGEDLLM_CPU_ISA`` if set, else ``detected_isa()``.

    Raises:
        ValueError: see ``parse_override``.
    """
    return parse_override(envs.PAGEDLLM_CPU_ISA.get()) or detected_isa()


def check_levels() -> list[str]:
    """The levels the kernel tests run and ``python -m pagedllm.kernels.cpu --every-level``
    builds, lowest first: ``portable`` and the selected level, with the AVX-512 levels below it
    (``avx512`` under ``avx512_bf16``). ``avx2`` is checked where it is the selected level (an
    AVX2 CPU, or ``PAGEDLLM_CPU_ISA=avx2``), not by default on an AVX-512 CPU: emulated there it
    misses what a real AVX2 CPU does (oneDNN's int8 GEMMs stay exact there and saturate on AVX2)
    and costs one more build of every kernel."""
    selected = selected_isa()
    avx512_below = [level for level in LEVELS[: LEVELS.index(selected)] if level.startswith("avx512")]
    return list(dict.fromkeys(["portable", *avx512_below, selected]))


def library_env(level: str) -> dict[str, str]:
    """The environment that caps oneDNN, ATen and MKL at ``level`` (see the module docstring)."""
    return dict(_LIBRARY_ENV[level])


def override_library_env() -> dict[str, str]:
    """``library_env`` of the ``PAGEDLLM_CPU_ISA`` override when it is below the host's level,
    else empty (the libraries then pick their own best path, AMX included). An invalid
    override yields empty too; it is reported when the kernels are loaded."""
    try:
        level = parse_override(envs.PAGEDLLM_CPU_ISA.get())
    except ValueError:
        return {}
    if level is None or level == detected_isa():
        return {}
    return library_env(level)
