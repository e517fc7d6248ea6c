"""The preload daemon as a fork server: ``pagedllm serve --load-format ipc_cache`` (and ``pagedllm
snapshot restore``) asks the running daemon to fork the server instead of starting one.

The daemon has already imported torch, transformers' config and model modules, FastAPI and
the engine (``warm_up``); a process forked from it starts serving without paying for those
imports again, and maps the weights from the store as any ``ipc_cache`` engine does (the key
is checked in the forked server, with the client's environment).

::

    pagedllm serve (client)                      daemon                      forked server
      connect control.sock, send {"op": "fork",  --> fork() ------------------> setsid, fds 0-2 :=
        argv, env, cwd, executable} + fds 0,1,2       (reaps it later)          the client's, env, cwd;
      <-- {"pid": P}                                                             run_server(argv)
      forward SIGINT / SIGTERM to P                                              ...
      <-- {"exit_code": N}  (EOF without one: 1) <------------------------------ on exit
                                                  client gone (EOF): the server stops itself (SIGTERM)

The daemon refuses (``{"refused": reason}``; the client then starts the server itself) when
the client's interpreter, ``sys.path`` or an environment variable that the imports or the
loader read before the fork (``INHERITED_ENV_PREFIXES``: ``PAGEDLLM_*`` but the folders,
``VLLM_*``, ``OMP_*``, ``PYTHON*``, ...) differs from its own. A forked server keeps serving
when the daemon stops or is killed (its own session, the store's pages stay mapped).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from pagedllm import envs

logger = logging.getLogger(__name__)

OP = "fork"
#: The daemon's control socket in its folder.
SOCKET_NAME = "control.sock"
#: Environment variables read before the fork (imports, platform, loader): a client must
#: agree with the daemon on every one of them.
INHERITED_ENV_PREFIXES = ("PAGEDLLM_", "VLLM_", "OMP_", "KMP_", "MKL_", "GOMP_", "ONEDNN_", "DNNL_", "ATEN_", "TORCH",
                          "PYTORCH_", "CUDA_", "HF_", "TRANSFORMERS_", "PYTHON", "LD_")
#: Variables of that kind read afresh after the fork (where the stores and snapshots are).
NOT_INHERITED = ("PAGEDLLM_PRELOAD_DIR", "PAGEDLLM_SNAPSHOT_DIR")
_MAX_FDS = 3
_CHUNK = 1 << 16
#: Bytes an AF_UNIX address may have (Linux's ``sun_path`` is 108, with its NUL).
_MAX_UNIX_PATH = 107


@contextlib.contextmanager
def unix_address(path: Path) -> Iterator[str]:
    """``path`` as an address to ``bind`` or ``connect`` an AF_UNIX socket to: itself, or where
    it is longer than ``sun_path`` holds (a deep ``PAGEDLLM_PRELOAD_DIR``, a snapshot's
    ``weights/``) the same file reached through an open descriptor of its folder
    (``/proc/self/fd/N/<name>``), valid inside the ``with``. FileNotFoundError when the
    folder does not exist."""
    if len(os.fsencode(str(path))) <= _MAX_UNIX_PATH:
        yield str(path)
        return
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{folder}/{path.name}"
    finally:
        os.close(folder)


def receive(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One JSON request line from ``connection`` and the file descriptors sent with it."""
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, got, _, _ = socket.recv_fds(connection, _CHUNK, _MAX_FDS)
        if not chunk:
            break
        data, fds = data + chunk, fds + got
    return json.loads(data or b"{}"), fds


def _inherited_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(INHERITED_ENV_PREFIXES) and k not in NOT_INHERITED}


def refusal(request: dict[str, Any]) -> Optional[str]:
    """Why this daemon cannot fork the server ``request`` asks for, or None."""
    if request.get("executable") != sys.executable:
        return f"the interpreter differs (daemon: {sys.executable}, server: {request.get('executable')})"
    if request.get("package") != _package_dir():
        return f"the pagedllm package differs (daemon: {_package_dir()}, server: {request.get('package')})"
    # The daemon's imports may append entries (setuptools appends its ``_vendor`` folder when
    # torch's extension loader imports it): the server's path must be the daemon's start.
    ours_path, theirs_path = sys.path[1:], request.get("sys_path") or []
    if ours_path[: len(theirs_path)] != theirs_path:
        return f"sys.path differs (daemon: {ours_path}, server: {theirs_path})"
    ours, theirs = _inherited_env(dict(os.environ)), _inherited_env(request.get("env") or {})
    for name in sorted(set(ours) | set(theirs)):
        if ours.get(name) != theirs.get(name):
            return f"{name} differs (daemon: {ours.get(name)!r}, server: {theirs.get(name)!r})"
    return None


def _package_dir() -> str:
    return str(Path(__file__).resolve().parents[1])


def fork(connection: socket.socket, request: dict[str, Any], fds: list[int], listener: socket.socket,
         run_server: Callable[[list[str]], int]) -> None:
    """Answer a fork request in the daemon: refuse it, or fork the server (``run_server(argv)``
    in the child, see ``_run_child``) and reap it in a thread. Closes ``fds`` here."""
    try:
        reason = refusal(request) if len(fds) == _MAX_FDS else "the client sent no standard streams"
        if reason is not None:
            connection.sendall((json.dumps({"refused": reason}) + "\n").encode())
            return
        from pagedllm.executor.mp_context import release_openmp_threads

        release_openmp_threads()  # a forked child would wait for the pool's missing threads
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(connection, request, fds, listener, run_server)  # never returns
        connection.sendall((json.dumps({"pid": pid}) + "\n").encode())
        threading.Thread(target=os.waitpid, args=(pid, 0), name=f"reap-{pid}", daemon=True).start()
        logger.info("Forked a server (pid %d): pagedllm %s", pid, " ".join(request["argv"]))
    finally:
        for fd in fds:
            os.close(fd)


def _run_child(connection: socket.socket, request: dict[str, Any], fds: list[int], listener: socket.socket,
               run_server: Callable[[list[str]], int]) -> None:
    """The forked server: the client's streams, folder and environment, its own session;
    runs ``run_server`` and sends its exit code; exits (never returns)."""
    code = 1
    try:
        listener.close()
        os.setsid()  # the daemon's signals (its terminal's Ctrl-C) are not the server's
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["pagedllm", *request["argv"]]
        threading.Thread(target=_stop_when_client_leaves, args=(connection,), name="fork-client", daemon=True).start()
        code = run_server(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            connection.sendall((json.dumps({"exit_code": code}) + "\n").encode())
        except OSError:
            pass
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stop_when_client_leaves(connection: socket.socket) -> None:
    """Block until the client's end closes (it sends nothing more), then stop the server as
    SIGTERM does."""
    try:
        while connection.recv(_CHUNK):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def serve_forked(argv: list[str], env: Optional[dict[str, str]] = None, cwd: Optional[str] = None,
                 root: Optional[Path] = None) -> Optional[int]:
    """Ask the daemon of ``root`` (None: ``PAGEDLLM_PRELOAD_DIR``) to fork the server of ``pagedllm <argv>`` (in ``env``, None:
    this process's, and the folder ``cwd``) with this process's standard streams; forward
    SIGINT and SIGTERM to it and return its exit code once it exits (1 when it died without
    one). None when no daemon answers or it refused (logged): start the server here."""
    root = Path(envs.PAGEDLLM_PRELOAD_DIR.get()) if root is None else root
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with unix_address(root / SOCKET_NAME) as address:
            client.connect(address)
    except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
        client.close()
        return None
    request = {"op": OP, "argv": list(argv), "env": dict(os.environ if env is None else env),
               "cwd": os.path.abspath(cwd or os.getcwd()), "executable": sys.executable, "sys_path": sys.path[1:], "package": _package_dir()}
    sys.stdout.flush()
    sys.stderr.flush()
    with client:
        socket.send_fds(client, [(json.dumps(request) + "\n").encode()], [0, 1, 2])
        replies = client.makefile()
        reply = json.loads(replies.readline() or "{}")
        if "pid" not in reply:
            logger.warning("The preload daemon in %s does not fork this server (%s); starting it here.", root,
                           reply.get("refused") or reply.get("error") or "no answer")
            return None
        pid = reply["pid"]
        previous = {sig: signal.signal(sig, lambda signum, _: _forward(pid, signum))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            line = replies.readline()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if not line:
        print(f"pagedllm serve: the server forked by the preload daemon (pid {pid}) died without an exit code.",
              file=sys.stderr)
        return 1
    return int(json.loads(line)["exit_code"])


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
