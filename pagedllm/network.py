"""Local network helpers without torch (the front end uses them before torch is imported)."""

from __future__ import annotations

import socket


def get_open_port() -> int:
    """A TCP port on 127.0.0.1 free now (the OS's choice), for ``tcp://127.0.0.1:<port>``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
