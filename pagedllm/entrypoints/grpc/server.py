"""Start and stop the gRPC server of ``pagedllm serve --grpc`` (``grpc.aio``, on the event loop
that runs the HTTP server, over the same ``AsyncLLM``).

It listens on ``--host``:``--grpc-port`` without TLS (put a TLS-terminating proxy in front
for TLS) and serves ``pagedllm.v1.Generation`` (``GenerationServicer``).
"""

from __future__ import annotations

import logging
from typing import Sequence

import grpc

from pagedllm.engine.protocol import EngineClient

logger = logging.getLogger(__name__)


def grpc_address(host: str, port: int) -> str:
    """``host:port`` as gRPC takes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def start_grpc_server(
    engine: EngineClient, host: str, port: int, served_model_names: Sequence[str], api_keys: Sequence[str] = ()
) -> grpc.aio.Server:
    """A started ``grpc.aio`` server of the ``Generation`` service on ``host:port``; the caller
    stops it (``await server.stop(grace_seconds)``) before shutting the engine down.

    Raises:
        OSError: the port cannot be bound (in use, or a bad address): a one-line message.
        ImportError: grpcio-tools is missing (it generates the stubs: ``pagedllm.entrypoints.grpc.stubs``).
    """
    from pagedllm.entrypoints.grpc.servicer import GenerationServicer
    from pagedllm.entrypoints.grpc.stubs import load_stubs

    _, services = load_stubs()
    server = grpc.aio.server()
    services.add_GenerationServicer_to_server(GenerationServicer(engine, served_model_names, api_keys), server)
    address = grpc_address(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if not bound:
        raise OSError(f"cannot listen for gRPC on {address}: the port is in use or the address is bad; choose --grpc-port")
    await server.start()
    logger.info("gRPC server (pagedllm.v1.Generation) listening on %s", address)
    return server
