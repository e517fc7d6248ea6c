"""``pagedllm serve [MODEL] [flags]``: flags with vLLM's names and meanings, and ``main``.

A bad flag value is one line on stderr (``pagedllm serve: error: ...``) and exit code 2,
never a traceback. Sizes take human-readable values as vLLM: ``8192``, ``32k`` (x1000),
``32K`` (x1024), ``1M`` (x1024^2), ``25.6k``.

The flags are declared once, on dataclass fields: the server's on ``FrontendConfig``, the
engine's on ``EngineArgs`` (``pagedllm.config.engine_args``; ``pagedllm bench`` takes the
same). vLLM's common flags are all accepted: they act as in vLLM, are documented no-ops where they cannot matter, or, for a value asking
for something not built, fail at once with "... is not supported yet". ``--config
FILE.yaml``, ``--flag_with_underscores`` and "did you mean" for a misspelled flag: see
``pagedllm.entrypoints.arg_parsing``.

Module import stays light (argparse and the torch-free ``pagedllm.config``): the engine,
FastAPI and uvicorn are imported by ``main``.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import gc
import json
import logging
import os
import re
import signal
import socket
import stat
import sys
import types
from typing import Any, NoReturn, Optional

from pagedllm import envs
from pagedllm.config.arg_types import (  # noqa: F401  (re-exported: the parsers of serve's flags)
    fraction_type,
    human_readable_int,
    int_type,
    json_list_type,
    json_object,
    json_object_type,
    lora_module_type,
    max_model_len_type,
    non_negative_float,
    non_negative_seconds,
    port_type,
    positive_int,
)
from pagedllm.config.engine_args import EngineArgs, add_engine_args
from pagedllm.config.flags import add_flags
from pagedllm.entrypoints.arg_parsing import make_flexible
from pagedllm.entrypoints.openai.frontend_config import (  # noqa: F401  (re-exported)
    API_KEY_ENV_VARS,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    FrontendConfig,
)

class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to a flag's help when X says something (not None/False); the
    description and epilog keep their line breaks (the environment variables' list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS) or "default" in help_text.lower():
            return help_text
        return f"{help_text} (default: {default})"


def _one_line_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``serve`` flags to ``parser`` (``FrontendConfig``'s in the "server" group,
    ``EngineArgs``' in "engine", the model's at the top) and make its errors one line
    (exit code 2)."""
    parser.error = types.MethodType(_one_line_error, parser)  # type: ignore[method-assign]
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL",
        help="Model directory (Hugging Face layout) or a Hugging Face Hub id, downloaded on first use "
        "(HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE are honoured). Default: the small model shipped with pagedllm.",
    )  # fmt: skip
    server = parser.add_argument_group("server")
    engine = parser.add_argument_group("engine")
    add_flags(FrontendConfig, server)
    add_engine_args(parser, {"model": parser, "engine": engine, "server": server})
    make_flexible(parser)
    return parser


def serve_parser() -> argparse.ArgumentParser:
    """A parser of the ``pagedllm serve`` flags alone (``make_arg_parser``)."""
    return make_arg_parser(argparse.ArgumentParser(prog="pagedllm serve"))


def check_tool_calling_args(args: argparse.Namespace) -> None:
    """vLLM's start-up checks of the tool-calling flags.

    Raises:
        ValueError: ``--enable-auto-tool-choice`` without ``--tool-call-parser``, or a
            parser name that is not registered (the message lists the known ones).
    """
    from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if args.tool_call_parser:
        try:
            ToolParserManager.get_tool_parser(args.tool_call_parser)
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None


def check_reasoning_parser_args(args: argparse.Namespace) -> None:
    """vLLM's start-up check of ``--reasoning-parser``.

    Raises:
        ValueError: a parser name that is not registered (the message lists the known ones).
    """
    from pagedllm.reasoning import ReasoningParserManager

    if args.reasoning_parser:
        try:
            ReasoningParserManager.get_reasoning_parser(args.reasoning_parser)
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``pagedllm`` command (sets ``func`` to ``main``)."""
    parser = subparsers.add_parser(
        "serve",
        usage="%(prog)s [MODEL] [options]",
        help="Start the OpenAI-compatible HTTP server.",
        description="Start an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions,\n"
        "/v1/models, /tokenize, /detokenize, /health, /version, /metrics) and Anthropic's /v1/messages.\n"
        "Flags follow vLLM's.",
        epilog=envs.help_epilog(),
        formatter_class=_HelpFormatter,
    )
    make_arg_parser(parser)
    parser.set_defaults(func=main)
    return parser


def resolve_api_key(args: argparse.Namespace) -> Optional[list[str]]:
    """The accepted keys: ``--api-key``'s (one or more, as vLLM), else ``$PAGEDLLM_API_KEY``,
    else ``$VLLM_API_KEY``, else None."""
    if args.api_key:
        return list(args.api_key)
    key = envs.PAGEDLLM_API_KEY.get()
    return None if key is None else [key]


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """The server's ``EngineArgs`` of the parsed flags: every engine flag, ``usage_context``
    "api_server", and ``--reasoning-parser`` as the ``reasoning_parser`` of
    ``structured_outputs_config`` (unless that names one): constrained outputs start their
    grammar where the reasoning ends, as vLLM.

    Raises:
        ValueError: a flag missing from ``args``, or a bad value (see ``EngineArgs``).
    """
    engine_args = EngineArgs.from_cli_args(args, usage_context="api_server")
    if not getattr(args, "reasoning_parser", None):
        return engine_args
    structured_outputs = {"reasoning_parser": args.reasoning_parser, **(engine_args.structured_outputs_config or {})}
    return dataclasses.replace(engine_args, structured_outputs_config=structured_outputs)


def uvicorn_tls_kwargs(args: Any) -> dict[str, Any]:
    """uvicorn's TLS settings from ``--ssl-*`` (vLLM's flags; ``args``: a ``FrontendConfig`` or
    the parsed flags): with a certificate it serves HTTPS."""
    return {
        "ssl_keyfile": args.ssl_keyfile,
        "ssl_certfile": args.ssl_certfile,
        "ssl_ca_certs": args.ssl_ca_certs,
        "ssl_cert_reqs": args.ssl_cert_reqs,
    }


def _fetch_models(engine_args: Any) -> None:
    """Download the model and tokenizer named by Hub id (or find them in the cache) before the
    engine process starts, so a missing model fails here at once and the download happens once.

    Raises:
        ValueError: the model or tokenizer cannot be found (see ``resolve_model_path``).
    """
    from pagedllm.config import resolve_model_path

    resolve_model_path(engine_args.model, engine_args.revision, engine_args.download_dir)
    if engine_args.tokenizer:
        resolve_model_path(engine_args.tokenizer, engine_args.tokenizer_revision, engine_args.download_dir)


def _fail(message: str, code: int) -> int:
    one_line = " ".join(message.split())
    print(f"pagedllm serve: error: {one_line}", file=sys.stderr)
    return code


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening yet), taken before the model loads
    so that a busy port is reported at once (as vLLM); uvicorn serves on it later.

    Raises:
        OSError: the port is in use, or the address cannot be bound (a one-line message).
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise OSError(f"port {port} on {host} is already in use; stop the other server or choose --port") from None
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def bind_unix_socket(path: str) -> socket.socket:
    """A Unix domain socket bound to ``path`` (``--uds``, as vLLM: host and port are then
    ignored), taken before the model loads. A stale socket file (nothing listening) is replaced.

    Raises:
        OSError: another server listens on ``path``, or it cannot be bound (a one-line message).
    """
    if os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            if probe.connect_ex(path) == 0:
                raise OSError(f"{path} is already in use by another server; stop it or choose another --uds")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {path}: {exc.strerror}") from None
    return sock


def _reported_args(args: argparse.Namespace) -> Optional[list[str]]:
    """The flags ``GET /server_info`` reports (``server_info.reported_serve_args``) of the
    command line ``pagedllm`` records (``entrypoints.cli``); None without one."""
    from pagedllm.entrypoints.openai.server_info import reported_serve_args

    command_line = getattr(args, "command_line", None)
    return reported_serve_args(serve_parser(), command_line[1:]) if command_line else None


def _may_fork_from_daemon(args: argparse.Namespace) -> bool:
    """Whether this server may be forked by a running preload daemon (``preload.fork_server``):
    ``--load-format ipc_cache`` from the ``pagedllm`` command line, not already forked."""
    return (args.load_format == "ipc_cache" and bool(getattr(args, "command_line", None))
            and not getattr(args, "forked_by_daemon", False))


def _exit_on_sigterm(signum: int, _: Any) -> NoReturn:
    raise SystemExit(0)


def main(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM or the engine's death; returns the exit code.

    With ``--calculate-kv-cache-size`` it prints the KV-cache size and returns 0 at once.

    Exit codes: 0 after a shutdown by SIGINT/SIGTERM, 2 for a bad flag value (one line on
    stderr), 1 when the port is in use (one line, before the model loads), when the engine
    cannot start for another reason, or when it died while serving (so that a supervisor
    restarts the server, as vLLM).
    """
    if _may_fork_from_daemon(args):
        from pagedllm.preload.fork_server import serve_forked

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
        code = serve_forked(list(args.command_line))
        if code is not None:
            return code
    args.model = args.model_tag or args.model
    args.api_key = resolve_api_key(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if args.model is None:
        from pagedllm.model_paths import default_model_path

        if not (default_model_path() / "config.json").is_file():
            return _fail(f"no MODEL given, and the shipped default model is missing from {default_model_path()}.", 2)
    try:
        # the stats interval checked now (``metrics.loggers.log_stats_interval``), without
        # importing the metrics modules (prometheus_client) before the engine is forked
        envs.PAGEDLLM_LOG_STATS_INTERVAL.get()
        if args.lora_modules and not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora.")
        check_tool_calling_args(args)
        check_reasoning_parser_args(args)
        engine_args = engine_args_from(args)
        frontend = FrontendConfig.from_cli_args(args)
        _fetch_models(engine_args)
        if frontend.calculate_kv_cache_size:
            from pagedllm.entrypoints.kv_cache_size import kv_cache_size_report

            print(kv_cache_size_report(engine_args))
            return 0
    except ValueError as exc:
        return _fail(str(exc), 2)
    try:
        sock = bind_unix_socket(frontend.uds) if frontend.uds else bind_socket(frontend.host, frontend.port)
    except OSError as exc:
        return _fail(str(exc), 1)
    from pagedllm.executor.mp_context import close_in_forked_children

    close_in_forked_children(sock)  # the engine processes must not keep the port open
    # NOTE: uvicorn re-raises SIGTERM after its graceful shutdown; turning it into
    # SystemExit(0) lets the engine be shut down by the `finally` of `_serve` (also when
    # SIGTERM arrives while the model loads).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    import asyncio

    try:
        return asyncio.run(_serve(frontend, engine_args, sock, _reported_args(args)))
    except KeyboardInterrupt:
        return 0
    finally:
        sock.close()


async def _serve(frontend: FrontendConfig, engine_args: EngineArgs, sock: socket.socket,
                 reported_args: Optional[list[str]] = None) -> int:
    # NOTE: start-up order: this process resolves the configuration first (which imports
    # torch and transformers' config modules, most of a start's CPU time), then forks the
    # engine process, which inherits those modules and the configuration and loads the
    # model, while this process imports FastAPI and loads the tokenizer. Forking before the
    # imports had both processes import torch and transformers: twice the CPU time, which on
    # a busy (or 2-core) host is start-up time.
    try:
        config = engine_args.create_engine_config()
    except (ValueError, OSError) as exc:  # OSError: a model directory without a usable config.json
        return _fail(str(exc), 2)
    from pagedllm.engine.client_factory import make_client

    # NOTE: torch and transformers stay loaded for good: frozen now, they stay frozen here
    # after the fork too (``mp_context.start``), so the collection before serving scans only
    # what came after.
    gc.freeze()
    # one engine-core process, or one per data-parallel replica (``-dp``)
    engine_core = make_client(config, multiprocess=True, asyncio_mode=True, wait_for_ready=False)
    try:
        import uvicorn

        from pagedllm.engine.async_llm import AsyncLLM
        from pagedllm.entrypoints.openai.api_server import build_app
        from pagedllm.entrypoints.chat_utils import load_chat_template
        from pagedllm.entrypoints.openai.launcher import serve_http

        frontend = dataclasses.replace(frontend, chat_template=load_chat_template(frontend.chat_template))
        served_name = (frontend.served_model_name or [None])[0]
        engine = AsyncLLM(
            config,
            log_requests=not frontend.disable_log_requests,
            served_model_name=served_name,
            engine_core=engine_core,
            wait_for_ready=False,
        )
    except (ValueError, OSError) as exc:
        engine_core.shutdown(timeout_s=0)
        return _fail(str(exc), 2)
    except Exception as exc:  # one line, not a traceback
        logging.getLogger(__name__).debug("Engine start-up failed", exc_info=True)
        return _fail(f"the engine failed to start: {exc}", 1)
    try:
        # NOTE: the app (routes, request models, the tokenizer's tables) is built while the
        # engine still loads the model; then this process waits for it.
        try:
            app = build_app(engine, frontend, reported_args)
        except (ValueError, OSError) as exc:  # a --lora-modules adapter that cannot be served
            return _fail(str(exc), 2)
        try:
            engine.wait_for_ready()
        except (ValueError, OSError) as exc:
            return _fail(str(exc), 2)
        except Exception as exc:  # EngineStartupError and friends: one line, not a traceback
            logging.getLogger(__name__).debug("Engine start-up failed", exc_info=True)
            return _fail(f"the engine failed to start: {exc}", 1)
        # NOTE: torch and transformers leave millions of long-lived objects; without this,
        # each full garbage collection pauses the event loop (and /health) for 100+ ms.
        gc.collect()
        gc.freeze()
        config = uvicorn.Config(
            app,
            log_level=frontend.uvicorn_log_level,
            access_log=not frontend.disable_uvicorn_access_log,
            **uvicorn_tls_kwargs(frontend),
        )
        try:
            grpc_server = await _start_grpc(frontend, engine)
        except OSError as exc:
            return _fail(str(exc), 1)
        try:
            return await serve_http(config, engine, sock, frontend.shutdown_timeout)
        finally:
            if grpc_server is not None:  # gRPC calls still open may finish within the grace period
                await grpc_server.stop(grace=frontend.shutdown_timeout)
    finally:
        engine.shutdown()


async def _start_grpc(frontend: FrontendConfig, engine: Any) -> Any:
    """With ``--grpc``: the started gRPC server over ``engine`` (``pagedllm.entrypoints.grpc``);
    else None.

    Raises:
        OSError: ``--grpc-port`` cannot be bound.
    """
    if not frontend.grpc:
        return None
    from pagedllm.entrypoints.grpc.server import start_grpc_server

    names = list(frontend.served_model_name or [engine.model_config.model])
    return await start_grpc_server(engine, frontend.host, frontend.grpc_port, names, frontend.api_key or ())
