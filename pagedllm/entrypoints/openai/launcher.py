"""Run the HTTP server of ``pagedllm serve`` and stop it well (vLLM's ``launcher``).

- Shutdown (SIGTERM, or the first Ctrl-C): the listening socket closes at once (new
  connections are refused), requests already running may finish for ``shutdown_timeout``
  seconds (``--shutdown-timeout``), then each one still open is ended: a stream gets an
  error event (503, ``ServiceUnavailableError``) and ``data: [DONE]``, a plain request a 503
  response. A second Ctrl-C stops at once (uvicorn's force exit).
- Engine death: a watchdog checks every ``WATCHDOG_INTERVAL_S`` that the engine lives. When
  it died, the server logs why and stops (in-flight requests get their 500 first), and
  ``serve_http`` returns exit code 1, so that a supervisor restarts it, as vLLM does.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.errors import OpenAIServingError

logger = logging.getLogger(__name__)

#: Seconds between two checks that the engine is alive.
WATCHDOG_INTERVAL_S = 0.5
#: Seconds between two sweeps for open requests once the grace period is over.
_SWEEP_INTERVAL_S = 0.1


def shutting_down_error() -> OpenAIServingError:
    """The error requests still open at the end of the grace period get (503)."""
    return OpenAIServingError(
        "The server is shutting down; the request was stopped before it finished.", 503, "ServiceUnavailableError"
    )


class _Server(uvicorn.Server):
    """uvicorn's server, ending the engine's open requests after the grace period."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        ender = asyncio.create_task(self._end_open_requests())
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()

    async def _end_open_requests(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout
        while self.engine.get_num_unfinished_requests() and loop.time() < deadline:
            await asyncio.sleep(_SWEEP_INTERVAL_S)
        while True:  # until uvicorn is done: also requests that were still being received
            ended = self.engine.abort_all(shutting_down_error())
            if ended:
                logger.info(
                    "Shutdown: stopped %d request(s) still running after %.1f s: %s",
                    len(ended), self.shutdown_timeout, ", ".join(ended),
                )  # fmt: skip
            await asyncio.sleep(_SWEEP_INTERVAL_S)


async def _watch_engine(engine: EngineClient, server: _Server) -> None:
    while not engine.errored:
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
    logger.error("The engine is dead (%s); stopping the API server (exit code 1).", engine.dead_error)
    server.should_exit = True


async def serve_http(config: uvicorn.Config, engine: EngineClient, sock: socket.socket, shutdown_timeout: float) -> int:
    """Serve ``config.app`` on the bound ``sock`` until a signal or the engine's death.

    ``engine`` is an ``AsyncLLM`` (any ``EngineClient``); ``shutdown_timeout`` is the grace period in seconds.
    Returns the exit code: 0 after a shutdown by signal, 1 when the engine died.
    The caller shuts the engine down afterwards.
    """
    config.timeout_graceful_shutdown = int(shutdown_timeout) + 2  # a backstop: see _Server
    server = _Server(config, engine, shutdown_timeout)
    watchdog = asyncio.create_task(_watch_engine(engine, server))
    try:
        await server.serve(sockets=[sock])
    finally:
        watchdog.cancel()
    return 1 if engine.errored else 0
