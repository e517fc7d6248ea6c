"""How child processes start (``pagedllm.executor.mp_context``): fork by default, so a script
without a ``__main__`` guard runs ``-tp 2`` and ``-pp 2`` (greedy output equal to one process,
after a forward pass in the parent and with a thread running matmuls in it); spawn when the
variable (ours or vLLM's) asks for it or when forking is unsafe; bad values refused."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.executor import mp_context
from pagedllm.executor.mp_context import WORKER_MULTIPROC_METHOD_ENV, get_mp_context, requested_method
from pagedllm.platforms.cpu_binding import BIND_ENV
from tests.helpers import can_host_workers, random_prompts

SCRIPTS = Path(__file__).parent / "scripts"
#: A run starts three engines and four workers (15 s on 2 loaded cores): a child hangs.
SCRIPT_TIMEOUT_S = 120
needs_two_workers = pytest.mark.skipif(not can_host_workers(2), reason="needs 2 cores (CPU) or 2 GPUs (CUDA)")


@pytest.fixture
def clean_env(monkeypatch):
    for name in WORKER_MULTIPROC_METHOD_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _run_script(script: Path, model: Path) -> dict:
    """Run ``script MODEL``, each worker on two OpenMP threads (GNU OpenMP's pool inherited
    by a fork hangs only then); its JSON line."""
    environ = {k: v for k, v in os.environ.items() if k not in (*WORKER_MULTIPROC_METHOD_ENV, "OMP_NUM_THREADS")}
    two_cores = ",".join(str(core) for core in sorted(os.sched_getaffinity(0))[:2])
    environ.update({"PYTHONPATH": str(Path(__file__).parents[2]), BIND_ENV: f"{two_cores}|{two_cores}"})
    # its own process group: on a hang, the workers go too (they would wait for ever)
    process = subprocess.Popen(
        [sys.executable, str(script), str(model)], cwd=script.parent, env=environ,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"the script did not finish in {SCRIPT_TIMEOUT_S} s (a child hangs):\n{stderr[-5000:]}")
    assert process.returncode == 0, stdout[-3000:] + stderr[-5000:]
    return json.loads(stdout.strip().splitlines()[-1])


@needs_two_workers
def test_a_script_without_a_main_guard_runs_tp2_and_pp2_by_fork(tiny_llama):
    result = _run_script(SCRIPTS / "guardless_parallel.py", tiny_llama)
    assert result["tp2_start_method"] == result["pp2_start_method"] == "fork"
    assert len(result["tp1"]) == 3 and all(len(t) == 8 for t in result["tp1"])
    assert result["tp2"] == result["tp1"]
    assert result["pp2"] == result["tp1"]


@needs_two_workers
def test_spawn_chosen_by_vllms_variable_still_works(tiny_llama, clean_env):
    """In this process (whose main module is guarded): ``-tp 2`` by spawn, greedy output
    equal to one process."""
    clean_env.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    kwargs = dict(dtype="float32", max_model_len=128, block_size=8, num_gpu_blocks_override=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([8, 3, 1], 1000, seed=3)]
    expected = [o.outputs[0].token_ids for o in LLM(str(tiny_llama), **kwargs).generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **kwargs)
    try:
        executor = llm.llm_engine.engine_core.model_executor
        assert executor.start_method == "spawn"
        assert {type(w.process).__name__ for w in executor.workers} == {"SpawnProcess"}
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_fork_by_default_and_the_variables_in_order(clean_env):
    assert requested_method() == "fork"
    assert get_mp_context().get_start_method() == "fork"
    clean_env.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert get_mp_context().get_start_method() == "spawn"
    clean_env.setenv("PAGEDLLM_WORKER_MULTIPROC_METHOD", " Fork ")
    assert requested_method() == "fork"  # ours wins over vLLM's


@pytest.mark.parametrize("name", WORKER_MULTIPROC_METHOD_ENV)
def test_an_unknown_method_is_refused_naming_the_variable(clean_env, name):
    clean_env.setenv(name, "forkserver")
    with pytest.raises(ValueError, match=f"{name}='forkserver': use fork or spawn"):
        get_mp_context()


def test_spawn_with_a_warning_where_cuda_is_initialised(clean_env, caplog):
    clean_env.setattr(torch.cuda, "is_initialized", lambda: True)
    with caplog.at_level(logging.WARNING, logger=mp_context.__name__):
        context = get_mp_context()
    assert context is multiprocessing.get_context("spawn")
    assert "CUDA is initialised in this process: starting child processes with spawn" in caplog.text
    clean_env.setenv("PAGEDLLM_WORKER_MULTIPROC_METHOD", "spawn")
    caplog.clear()
    assert get_mp_context().get_start_method() == "spawn" and caplog.text == ""  # asked for: no warning


def _inode(fd: int):
    """What ``fd`` refers to now (None: nothing; a closed number may be reused)."""
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def _report_fd(fd: int, conn) -> None:
    conn.send(_inode(fd))


def test_a_registered_socket_is_closed_in_forked_children_only():
    import socket

    context = multiprocessing.get_context("fork")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        mp_context.close_in_forked_children(sock)
        fd, inode = sock.fileno(), _inode(sock.fileno())
        try:
            receiver, sender = context.Pipe(duplex=False)
            child = context.Process(target=_report_fd, args=(fd, sender))
            mp_context.start(context, child)
            assert receiver.recv() != inode  # closed in the child
            child.join(10)
            assert child.exitcode == 0 and sock.fileno() == fd and _inode(fd) == inode  # kept here
        finally:
            mp_context._close_after_fork.remove(sock)
