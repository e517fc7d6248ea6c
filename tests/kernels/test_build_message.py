"""A first build of the C++ CPU kernels is announced with its expected duration and timed
(issue 12, part 4); a load from the cache is not; ``python -m pagedllm.kernels.cpu`` (run by
``make install``) builds them ahead of the first start."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest

from pagedllm.kernels import cpu


@pytest.fixture
def messages(caplog):
    caplog.set_level(logging.DEBUG, logger=cpu.__name__)
    return lambda: [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]


def test_first_build_is_announced_and_timed(monkeypatch, tmp_path, messages):
    library = tmp_path / "ext" / "ext.so"
    library.parent.mkdir()

    def fake_build(name, cflags, ldflags):
        time.sleep(0.05)
        library.write_bytes(b"")

    monkeypatch.setattr(cpu, "_built_library", lambda name: str(library))
    monkeypatch.setattr(cpu, "_load_locked", fake_build)
    monkeypatch.setattr(cpu, "_builds", {})
    assert cpu._ensure_built("portable")
    first, built = messages()
    assert first == f"Building CPU kernels for portable (first start only, about {cpu._DEFAULT_BUILD_ESTIMATE_S} s)..."
    assert built.startswith("Built CPU kernels for portable in 0.") and str(library.parent) in built
    assert 0.05 <= float((tmp_path / cpu._BUILD_TIME_FILE).read_text()) < 5

    # another process finds the build in the cache: nothing at INFO
    monkeypatch.setattr(cpu, "_builds", {})
    assert cpu._ensure_built("portable")
    assert len(messages()) == 2

    # the next build (new sources) announces the duration this machine took last time
    library.unlink()
    (tmp_path / cpu._BUILD_TIME_FILE).write_text("42.4\n")
    monkeypatch.setattr(cpu, "_builds", {})
    assert cpu._ensure_built("portable")
    assert messages()[2] == "Building CPU kernels for portable (first start only, about 42 s)..."


def test_build_ahead_of_the_first_start():
    done = subprocess.run([sys.executable, "-m", "pagedllm.kernels.cpu"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(("pagedllm CPU kernels ready (", "pagedllm CPU kernels unavailable"))
