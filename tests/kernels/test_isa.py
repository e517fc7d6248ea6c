"""Instruction-set dispatch: the level is detected from the CPU's flags, ``PAGEDLLM_CPU_ISA``
forces a lower one (and caps oneDNN / ATen / MKL with it), a level above the host's or an
unknown name is refused with a clear error, and the kernels report the level they run at."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedllm.kernels import isa
from tests.conftest import supported_isas


def test_levels_follow_the_cpu_flags(monkeypatch):
    flags = {
        frozenset(): "portable",
        frozenset({"sse4_2", "avx", "avx2", "fma"}): "portable",  # no F16C: not the avx2 level
        frozenset({"avx", "avx2", "fma", "f16c", "bmi2"}): "avx2",
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}): "avx512",
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}): "avx512",
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}): "avx512",  # no VNNI
        frozenset(
            {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
        ): "avx512_bf16",
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_bf16"}): "avx2",  # AVX-512 without BW/VL/DQ
    }
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    for cpu, level in flags.items():
        monkeypatch.setattr(isa, "cpu_flags", lambda cpu=cpu: cpu)
        assert isa.detected_isa() == level, cpu
        assert isa.supported_isas() == list(isa.LEVELS[: isa.LEVELS.index(level) + 1])
    monkeypatch.setattr(isa.platform, "machine", lambda: "aarch64")
    assert isa.detected_isa() == "portable"


def test_checked_levels_are_portable_and_the_selected_family(monkeypatch):
    """What the kernel tests run and ``--every-level`` builds: avx2 only where it is selected."""
    checked = {
        ("portable", None): ["portable"],
        ("avx2", None): ["portable", "avx2"],
        ("avx512", None): ["portable", "avx512"],
        ("avx512_bf16", None): ["portable", "avx512", "avx512_bf16"],
        ("avx512_bf16", "avx2"): ["portable", "avx2"],
        ("avx512_bf16", "avx512"): ["portable", "avx512"],
        ("avx512_bf16", "portable"): ["portable"],
    }
    for (host, override), levels in checked.items():
        monkeypatch.setattr(isa, "detected_isa", lambda host=host: host)
        if override is None:
            monkeypatch.delenv(isa.ENV, raising=False)
        else:
            monkeypatch.setenv(isa.ENV, override)
        assert isa.check_levels() == levels, (host, override)


def test_override_is_validated(monkeypatch):
    monkeypatch.setattr(isa, "detected_isa", lambda: "avx2")
    assert isa.parse_override(None) is None and isa.parse_override(" ") is None
    assert isa.parse_override("AVX2") == "avx2" and isa.parse_override("portable") == "portable"
    with pytest.raises(ValueError, match="asks for more than this CPU supports.*up to 'avx2'"):
        isa.parse_override("avx512")
    with pytest.raises(ValueError, match="not one of portable, avx2, avx512, avx512_bf16"):
        isa.parse_override("sse9")
    monkeypatch.setenv(isa.ENV, "portable")
    assert isa.selected_isa() == "portable"
    assert isa.override_library_env() == isa.library_env("portable")
    monkeypatch.setenv(isa.ENV, "avx2")  # the host's own level: the libraries pick their best
    assert isa.override_library_env() == {}
    monkeypatch.setenv(isa.ENV, "avx512")  # invalid: reported when the kernels load, not here
    assert isa.override_library_env() == {}


PROBE = """
import pagedllm, torch
from pagedllm.kernels import cpu as k
print(torch.backends.cpu.get_cpu_capability(), bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
      k.build_info(), k.active_isa())
"""


@pytest.mark.isa_levels
@pytest.mark.parametrize("level", supported_isas())
def test_override_runs_the_whole_process_at_that_level(level):
    """``PAGEDLLM_CPU_ISA=<level>`` in a fresh process: the kernels run at that level and, below
    the host's, ATen and oneDNN are capped there too (e.g. no oneDNN bf16 below AVX-512)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")}
    env[isa.ENV] = level
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    aten, onednn_bf16, build, active = out.stdout.split()
    assert build.split(",")[0] == active == level
    assert f"pagedllm CPU kernels: {level} (this CPU supports up to {isa.detected_isa()}" in out.stderr
    if level != isa.detected_isa():
        assert aten == {"portable": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512"}[level]
        if level in ("portable", "avx2"):  # oneDNN emulates bf16 from AVX-512 up only
            assert onednn_bf16 == "False"


def test_override_above_the_host_fails_clearly(monkeypatch):
    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.kernels.cpu import runtime

    monkeypatch.setattr(isa, "detected_isa", lambda: "portable")
    monkeypatch.setenv(isa.ENV, "avx2")
    monkeypatch.setattr(runtime, "_active", None)
    monkeypatch.setattr(runtime, "_error", None)
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_ISA='avx2' asks for more than this CPU supports"):
        cpu_kernels.is_available()


def test_engine_args_refuse_a_bad_override_before_loading(monkeypatch):
    from pagedllm.config import EngineArgs

    monkeypatch.setenv(isa.ENV, "sse9")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_ISA='sse9' is not one of"):
        EngineArgs().create_engine_config()
