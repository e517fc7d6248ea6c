"""Shared fixtures: the tokenizer and tiny random checkpoints (built once per session, offline).

Checkpoints (all hidden 64, 2 layers, 4 heads / 2 KV heads, FFN 128, vocab 1024, float32;
each with its own seed, so no two share weights):

- ``tiny_llama``: LlamaForCausalLM, untied embeddings.
- ``tiny_llama3_rope``: the same with ``rope_scaling`` llama3 (factor 8, original 256,
  rope_theta 500000), so every rope frequency regime (kept, scaled, blended) is used.
- ``tiny_qwen2``: Qwen2ForCausalLM, q/k/v biases, tied embeddings, rope_theta 1e6 (as
  Qwen2.5-0.5B).
- ``tiny_qwen3``: Qwen3ForCausalLM, q/k norms, head_dim 32 (not hidden / heads = 16).
- ``tiny_mistral``: MistralForCausalLM, no sliding window.

``checkpoint_factory(arch, **kwargs)`` makes any other one (arguments of
``tests.fixtures.checkpoints.make_checkpoint``), cached by its arguments.

Kernel builds: the tests of every instruction-set level they check (``isa_kernel``, or marked
``isa_levels``; ``supported_isas``) need one C++ build per level (about a minute each on 2 cores). They are built at the lowest CPU priority by a
background process started when those tests are collected, while the other tests run (they
leave a core idle much of the time), and those tests run last: by then their builds are in
the cache (a build still running is waited for, through its lock).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import openai
import pytest

from pagedllm import envs
from pagedllm.kernels import isa
from tests.fixtures.checkpoints import build_tokenizer, make_checkpoint
from tests.server_utils import API_KEY, MODEL_ALIAS, MODEL_NAME, OTHER_API_KEY, RemoteServer


def supported_isas() -> list[str]:
    """The levels kernel tests run at (``isa.check_levels``: portable and the selected level,
    with the AVX-512 levels below it; avx2 where it is the selected one)."""
    return isa.check_levels()

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


@pytest.fixture(scope="session")
def tokenizer():
    """The 1024-token byte-level BPE tokenizer every tiny checkpoint uses."""
    return build_tokenizer()


@pytest.fixture(scope="session")
def server(tiny_llama: Path) -> Iterator[RemoteServer]:
    """The shared ``pagedllm serve`` of ``tiny_llama`` (settings in ``tests.server_utils``),
    started once per pytest worker: with xdist's ``--dist loadfile`` a worker runs files of
    different packages in turn, so a narrower scope would start it again and again. Read-only
    use: do not kill its engine or change what it serves."""
    remote = RemoteServer(
        tiny_llama,
        "--served-model-name", MODEL_NAME, MODEL_ALIAS,
        "--max-model-len", "2K",  # = MAX_MODEL_LEN (upper-case suffix: x1024, as vLLM)
        api_key=API_KEY, other_api_keys=(OTHER_API_KEY,),
    )  # fmt: skip
    try:
        yield remote
    finally:
        remote.close()


@pytest.fixture(scope="session")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def default_model_server() -> Iterator[RemoteServer]:
    """``pagedllm serve`` of the shipped model, as a first user starts it (default
    structured-outputs config), with ``--enable-auto-tool-choice --tool-call-parser hermes``
    (read-only use)."""
    remote = RemoteServer(None, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        yield remote
    finally:
        remote.close()


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """``factory(arch, **make_checkpoint_kwargs) -> Path``; equal arguments reuse one folder."""
    cache: dict[str, Path] = {}

    def factory(arch: str, **kwargs) -> Path:
        key = json.dumps([arch, kwargs], sort_keys=True, default=str)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-{arch}")
            cache[key] = make_checkpoint(out, arch, **kwargs)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(checkpoint_factory) -> Path:
    return checkpoint_factory("LlamaForCausalLM", seed=0)


@pytest.fixture(scope="session")
def llama_128(checkpoint_factory) -> Path:
    """A random-weight Llama whose linear inputs (128, 256) are whole groups of 32 to 128
    inputs (the quantization formats' groups)."""
    return checkpoint_factory("LlamaForCausalLM", seed=5, hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="session")
def tiny_llama3_rope(checkpoint_factory) -> Path:
    return checkpoint_factory(
        "LlamaForCausalLM", seed=4, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE_SCALING
    )


@pytest.fixture(scope="session")
def tiny_qwen2(checkpoint_factory) -> Path:
    return checkpoint_factory(
        "Qwen2ForCausalLM", seed=1, tie_word_embeddings=True, rope_theta=1000000.0
    )


@pytest.fixture(scope="session")
def tiny_qwen3(checkpoint_factory) -> Path:
    return checkpoint_factory("Qwen3ForCausalLM", seed=2, head_dim=32, rope_theta=1000000.0)


@pytest.fixture(scope="session")
def tiny_mistral(checkpoint_factory) -> Path:
    return checkpoint_factory("MistralForCausalLM", seed=3)


@pytest.fixture(scope="session")
def kernel():
    """The C++ CPU kernels module at this process's level, built or loaded; fails (with the
    reason) where they cannot be built: the kernels are part of what CI checks, not optional
    there."""
    from pagedllm.kernels import cpu as cpu_kernels

    assert cpu_kernels.is_available(), f"C++ CPU kernels unavailable: {cpu_kernels.runtime._error or 'disabled by env'}"
    return cpu_kernels


@pytest.fixture
def disable_cpu_kernels():
    """``disable(disabled=True)``: set ``PAGEDLLM_DISABLE_CPU_KERNELS=1`` (or, with False,
    unset it) for the rest of the test and have the kernels module re-read it at once (it reads
    the variable once per process: ``cpu_kernels.reread_env``). The variable and the module's
    reading of it are restored after the test."""
    from pagedllm.kernels import cpu as cpu_kernels

    before = os.environ.get(cpu_kernels.DISABLE_ENV)

    def disable(disabled: bool = True) -> None:
        if disabled:
            os.environ[cpu_kernels.DISABLE_ENV] = "1"
        else:
            os.environ.pop(cpu_kernels.DISABLE_ENV, None)
        cpu_kernels.reread_env()

    yield disable
    if before is None:
        os.environ.pop(cpu_kernels.DISABLE_ENV, None)
    else:
        os.environ[cpu_kernels.DISABLE_ENV] = before
    cpu_kernels.reread_env()


@pytest.fixture(scope="module", params=supported_isas())
def isa_kernel(request, kernel):
    """The kernels module switched to each instruction-set level ``supported_isas`` names in
    turn (``portable`` up to the selected level): kernel tests run each of those paths."""
    with kernel.using_isa(request.param):
        assert kernel.build_info().split(",")[0] == request.param
        yield kernel


def pytest_report_header(config):
    """The CPU's instruction-set level, the override, and the kernels' build (or why none)."""
    from pagedllm.kernels import cpu as cpu_kernels

    override = os.environ.get(isa.ENV) or "unset"
    try:
        built = f"built, {cpu_kernels.build_info()}" if cpu_kernels.is_available() else f"unavailable ({cpu_kernels.runtime._error or 'disabled by env'})"
    except ValueError as exc:
        built = f"unavailable ({exc})"
    return f"pagedllm CPU ISA: detected {isa.detected_isa()}, {isa.ENV}={override}; C++ kernels: {built}; kernel tests run at: {', '.join(supported_isas())}"


#: Builds each level named on its command line (``using_isa`` builds a level it enters).
_PREBUILD = "import sys\nfrom pagedllm.kernels import cpu\nfor level in sys.argv[1:]:\n    with cpu.using_isa(level):\n        pass\n"
_prebuild: list[subprocess.Popen] = []


def pytest_configure(config):
    config.addinivalue_line("markers", "isa_levels: runs the kernels of every level (in another process): run last")
    config.addinivalue_line("markers", "serial: asserts a latency bound; `make test` runs it alone, after the parallel run")


def _needs_every_level(item) -> bool:
    return "isa_kernel" in getattr(item, "fixturenames", ()) or item.get_closest_marker("isa_levels") is not None


@pytest.hookimpl(trylast=True)  # after pytest's own grouping of parametrized fixtures
def pytest_collection_modifyitems(session, config, items):
    """Run the tests of every instruction-set level last, and start building their levels
    in the background now (see the module docstring)."""
    by_level = [item for item in items if _needs_every_level(item)]
    if not by_level:
        return
    items[:] = [item for item in items if not _needs_every_level(item)] + by_level
    if config.option.collectonly or envs.PAGEDLLM_DISABLE_CPU_KERNELS.get():
        return
    _prebuild.append(subprocess.Popen(
        [sys.executable, "-c", _PREBUILD, *supported_isas()], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, preexec_fn=lambda: os.nice(19),
    ))  # fmt: skip


def pytest_sessionfinish(session, exitstatus):
    """Stop a background build still running (a run cut short): its process group, compilers
    included; the build's lock dies with it."""
    for process in _prebuild:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
