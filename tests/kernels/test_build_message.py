"""A build of the C++ CPU kernels is announced with its reason and expected duration and
timed; a load from the cache is not; ``python -m pagedllm.kernels.cpu`` (run by
``make install``) builds them ahead of the first start."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time

import pytest

from pagedllm.kernels import cpu
from pagedllm.kernels.cpu import build


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

    loaded_as_built = []
    monkeypatch.setattr(build, "_built_library", lambda name: str(library))
    monkeypatch.setattr(build, "_load_locked", fake_build)
    monkeypatch.setattr(build, "_load_built", lambda path: loaded_as_built.append(path) or True)
    assert build.load("portable") is None
    assert loaded_as_built == []  # built through torch's cpp_extension
    first, built = messages()
    assert first == (
        f"Building CPU kernels for portable: no cached build for this key (about {build._DEFAULT_BUILD_ESTIMATE_S} s)..."
    )
    assert built.startswith("Built CPU kernels for portable in 0.") and str(library.parent) in built
    assert 0.05 <= float((tmp_path / f"{build._BUILD_TIME_FILE}_portable").read_text()) < 5

    # another process finds the build in the cache: loaded as it is, nothing at INFO
    assert build.load("portable") is None
    assert len(messages()) == 2 and loaded_as_built == [str(library)]

    # a source newer than the cached build: ninja rebuilds, and the rebuild is announced
    os.utime(library, (1, 1))
    assert build.load("portable") is None
    assert messages()[2].startswith("Building CPU kernels for portable: sources changed since the cached build (")

    # the next build announces the duration this machine took last time for that level
    library.unlink()
    (tmp_path / f"{build._BUILD_TIME_FILE}_portable").write_text("42.4\n")
    (tmp_path / f"{build._BUILD_TIME_FILE}_avx2").write_text("7\n")
    assert build.load("portable") is None
    assert messages()[4] == "Building CPU kernels for portable: no cached build for this key (about 42 s)..."


def test_cached_build_loads_without_cpp_extension():
    """An up-to-date build loads as it is: neither ``torch.utils.cpp_extension`` nor setuptools
    is imported (0.1-0.2 s of an engine's start), and its operators run."""
    code = (
        "import sys, torch\n"
        "from pagedllm.kernels.cpu import runtime\n"
        "ok = runtime.is_available()\n"
        "x = torch.randn(3, 64)\n"
        "from pagedllm.kernels.cpu import ops\n"
        "expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)\n"
        "ran = ok and torch.allclose(ops.rms_norm(x, torch.ones(64), 1e-6), expected, atol=1e-5)\n"
        "print(ok, ran, 'torch.utils.cpp_extension' in sys.modules, 'setuptools' in sys.modules)\n"
    )
    run = lambda: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    run()  # builds the kernels where they are not cached yet
    done = run()
    assert done.returncode == 0, done.stderr[-2000:]
    if done.stdout.split()[0] == "False":
        pytest.skip("the kernels cannot be built here")
    assert done.stdout.split() == ["True", "True", "False", "False"], done.stderr[-2000:]


def test_build_folder_and_key_paths_are_cpp_extensions(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    assert build._include_paths() == cpp_extension.include_paths()
    monkeypatch.setenv("CXX", "g++")
    assert build._compiler() in (cpp_extension.get_cxx_compiler(), shutil.which("g++"))
    monkeypatch.delenv("CXX")
    assert os.path.basename(build._compiler()) == cpp_extension.get_cxx_compiler()
    name = "pagedllm_build_folder_probe"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build._build_directory(name) == cpp_extension._get_build_directory(name, verbose=False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    folder = cpp_extension._get_build_directory(name, verbose=False)  # creates it
    try:
        assert build._build_directory(name) == folder
    finally:
        os.rmdir(folder)


def test_build_key_covers_the_whole_build_command():
    """The key (hence the build directory) changes with anything ``build.ninja`` holds, so
    two environments sharing one source tree do not rebuild each other's objects."""
    cflags, ldflags = build.build_flags("avx2")
    base = dict(include_paths=["/venv-a/torch/include"], python="/venv-a/bin/python", compiler="/usr/bin/c++")
    key = build.build_key(cflags, ldflags, **base)
    assert key == build.build_key(cflags, ldflags, **base) and len(key) == 12
    variants = [
        dict(base, include_paths=["/venv-b/torch/include"]),
        dict(base, python="/venv-b/bin/python"),
        dict(base, compiler="/usr/bin/clang++"),
    ]
    keys = {build.build_key(cflags, ldflags, **variant) for variant in variants}
    keys |= {build.build_key(cflags + ["-g"], ldflags, **base), build.build_key(cflags, ldflags + ["-g"], **base)}
    assert key not in keys and len(keys) == 5
    assert build.extension_name("avx2", cflags, ldflags).endswith("_avx2_" + build.build_key(cflags, ldflags))


def test_build_ahead_of_the_first_start():
    done = subprocess.run([sys.executable, "-m", "pagedllm.kernels.cpu"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(("pagedllm CPU kernels ready (", "pagedllm CPU kernels unavailable"))


def test_every_level_builds_each_level_the_kernel_tests_run():
    """``--every-level`` (``make test``'s set-up) leaves a build of every level from portable up
    to the selected one, so kernel tests at lower levels wait for no compiler."""
    from tests.conftest import supported_isas

    done = subprocess.run([sys.executable, "-m", "pagedllm.kernels.cpu", "--every-level"], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    if done.stdout.startswith("pagedllm CPU kernels unavailable"):
        pytest.skip("no C++ compiler: the kernels are not built at any level")
    ready = "pagedllm CPU kernels ready ("
    built = [line.removeprefix(ready).split(",")[0] for line in done.stdout.splitlines() if line.startswith(ready)]
    levels = supported_isas()
    assert built == [levels[-1], *levels[:-1]], done.stdout
