"""Signals in pagedllm's child processes (the engine core, the executor's workers).

A terminal's Ctrl-C sends SIGINT to the whole foreground process group, and several
supervisors stop a service by sending SIGTERM to all of its processes at once (systemd's
default ``KillMode=control-group``, ``timeout``, ``kill -- -PGID``, supervisord's
``stopasgroup``). The parent (the API server, or the engine core for its workers) gets the
same signal and shuts its children down in order: the server first lets running requests
finish for ``--shutdown-timeout`` seconds. A child that exited at once would fail those
requests (HTTP 500 "the engine is dead") and make the server exit with status 1.

So a child ignores SIGINT, and ignores SIGTERM while its parent lives; SIGTERM to an
orphan exits it (``SystemExit(0)``). A parent that must stop a child at once kills it
(SIGKILL).
"""

from __future__ import annotations

import os
import signal
from typing import Any


def follow_parent_on_signals(parent_pid: int) -> None:
    """Install the child's handlers (see the module docstring) in this process's main
    thread; ``parent_pid`` is the process that decides when this one stops."""

    def on_sigterm(signum: int, frame: Any) -> None:
        if os.getppid() != parent_pid:  # orphaned: nobody else will stop this process
            raise SystemExit(0)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_sigterm)
    # NOTE: a forked child inherits its parent's wakeup fd (an asyncio loop's socket):
    # its signals would wake the parent's loop as if they were the parent's.
    signal.set_wakeup_fd(-1)
