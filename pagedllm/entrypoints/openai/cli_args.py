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
from dataclasses import dataclass
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
from pagedllm.config.flags import add_flags, flag_field, flag_values, not_a_flag
from pagedllm.entrypoints.arg_parsing import make_flexible

#: Environment variables read (in this order) when ``--api-key`` is not given.
API_KEY_ENV_VARS = ("PAGEDLLM_API_KEY", "VLLM_API_KEY")

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
#: ``--shutdown-timeout``: seconds running requests may take to finish on SIGTERM / Ctrl-C.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help when X says something (not None/False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS) or "default" in help_text.lower():
            return help_text
        return f"{help_text} (default: {default})"


def _one_line_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


class _NotBuilt(argparse.Action):
    """A vLLM flag for a feature not built yet: giving it is a one-line error (exit 2)."""

    def __init__(self, option_strings: list[str], dest: str, why: str, nargs: Any = None, **kwargs: Any) -> None:
        kwargs.setdefault("help", f"Not supported yet: {why}.")
        super().__init__(option_strings, dest, nargs=nargs, **kwargs)
        self.why = why

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        parser.error(f"{option_string} is not supported yet ({self.why}).")


def _tool_parser_metavar() -> str:
    """``--tool-call-parser``'s metavar: the registered parsers' names."""
    from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager

    return "{" + ",".join(ToolParserManager.names()) + "}"


@dataclass(frozen=True)
class FrontendConfig:
    """The OpenAI server's own settings (vLLM's ``FrontendArgs``): one field per ``server``
    flag of ``pagedllm serve`` (names and defaults as vLLM's), built once from the parsed
    flags by ``from_cli_args`` and read by ``build_app`` and ``main``.

    ``api_key`` holds the accepted keys (``resolve_api_key``), ``chat_template`` the
    template text once ``main`` has loaded it. ``disable_log_stats`` is ``EngineArgs``'
    flag, listed with the server's.
    """

    host: str = flag_field(
        "127.0.0.1",
        help="Address to listen on. Use --host 0.0.0.0 to listen on all interfaces.",
    )
    port: int = flag_field(
        8000,
        help="Port to listen on.",
        type=port_type,
    )
    served_model_name: Optional[list[str]] = flag_field(
        None,
        help=(
            "Model name(s) clients use in the 'model' field; the first is the one reported. Default: "
            "MODEL as given (the shipped model: pagedllm-default)."
        ),
        metavar="NAME", nargs="+",
    )
    chat_template: Optional[str] = flag_field(
        None,
        help=(
            "Chat template for /v1/chat/completions: a file path, or the Jinja template itself. "
            "Default: the tokenizer's."
        ),
    )
    api_key: Optional[list[str]] = flag_field(
        None,
        help=(
            "Require 'Authorization: Bearer <key>', with one of these keys, on every route except /health and "
            f"/metrics. Also read from ${API_KEY_ENV_VARS[0]}, then ${API_KEY_ENV_VARS[1]} (one key)."
        ),
        metavar="KEY", nargs="+",
    )
    disable_log_requests: bool = flag_field(
        False,
        help="Do not log each request.",
        action="store_true",
    )
    uvicorn_log_level: str = flag_field(
        "info",
        help="Log level of the HTTP server (uvicorn).",
        choices=_LOG_LEVELS,
    )
    disable_uvicorn_access_log: bool = flag_field(
        False,
        help="Do not log each HTTP access.",
        action="store_true",
    )
    shutdown_timeout: float = flag_field(
        DEFAULT_SHUTDOWN_TIMEOUT_S,
        help=(
            "On SIGTERM or Ctrl-C, stop accepting connections and let running requests finish for up "
            "to this many seconds; then end each open stream with an error event and [DONE]."
        ),
        type=non_negative_seconds, metavar="SECONDS",
    )
    config: Optional[str] = flag_field(  # read by ``make_flexible`` (``CONFIG_FLAG``)
        None,
        help=(
            "Read flags from a YAML file: keys are flag names without the leading dashes (e.g. "
            "'tensor-parallel-size: 1'); flags on the command line win over the file."
        ),
        metavar="FILE.yaml",
    )
    uds: Optional[str] = flag_field(
        None,
        help="Listen on this Unix domain socket instead of --host/--port.",
        metavar="PATH",
    )
    root_path: Optional[str] = flag_field(
        None,
        help="FastAPI root_path, for a server behind a path-based proxy.",
    )
    ssl_keyfile: Optional[str] = flag_field(
        None,
        help="TLS: the server's private key file (PEM).",
    )
    ssl_certfile: Optional[str] = flag_field(
        None,
        help="TLS: the server's certificate file (PEM); serves HTTPS.",
    )
    ssl_ca_certs: Optional[str] = flag_field(
        None,
        help="TLS: CA certificates to check client certificates.",
    )
    ssl_cert_reqs: int = flag_field(
        0,
        help=(
            "TLS: whether client certificates are required (Python's ssl.CERT_NONE=0, "
            "CERT_OPTIONAL=1, CERT_REQUIRED=2)."
        ),
        type=int_type,
    )
    allowed_origins: list[str] = flag_field(
        ['*'],
        help='CORS: Origins allowed, as a JSON list, e.g. \'["https://a.example"]\'.',
        type=json_list_type,
    )
    allowed_methods: list[str] = flag_field(
        ['*'],
        help='CORS: HTTP methods allowed, as a JSON list, e.g. \'["https://a.example"]\'.',
        type=json_list_type,
    )
    allowed_headers: list[str] = flag_field(
        ['*'],
        help='CORS: Request headers allowed, as a JSON list, e.g. \'["https://a.example"]\'.',
        type=json_list_type,
    )
    allow_credentials: bool = flag_field(
        False,
        help="CORS: allow credentials (cookies).",
        action="store_true",
    )
    response_role: str = flag_field(
        "assistant",
        help="Role of the reply in chat completions when add_generation_prompt is true.",
    )
    return_tokens_as_token_ids: bool = flag_field(
        False,
        help="Logprobs name tokens 'token_id:{id}' instead of their text.",
        action="store_true",
    )
    enable_log_requests: bool = flag_field(
        False,
        help="Log each request: pagedllm does so unless --disable-log-requests is given.",
        action="store_true",
    )
    enable_auto_tool_choice: bool = flag_field(
        False,
        help=(
            'Chat requests may use tool_choice "auto": the model\'s calls are read from its text by '
            "--tool-call-parser."
        ),
        action="store_true",
    )
    tool_call_parser: Optional[str] = flag_field(
        None,
        help="The format of the model's tool calls, for --enable-auto-tool-choice.",
        metavar=_tool_parser_metavar,
    )
    reasoning_parser: Optional[str] = flag_field(
        None,
        help="Not supported yet: reasoning parsers are not built.",
        action=_NotBuilt, extra={"why": "reasoning parsers are not built"},
    )
    lora_modules: Optional[list[dict[str, Any]]] = flag_field(
        None,
        help=(
            'LoRA adapters to serve (with --enable-lora), each \'name=path\' or a JSON object \'{"name":'
            ' ..., "path": ..., "base_model_name": ...}\'; a request selects one by its name in '
            "'model'."
        ),
        type=lora_module_type, metavar="name=path | JSON", nargs="+",
    )
    disable_log_stats: bool = not_a_flag(False, why="EngineArgs' flag --disable-log-stats (server group)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> FrontendConfig:
        """The config of parsed ``pagedllm serve`` flags, then ``overrides``.

        Raises:
            ValueError: ``args`` lacks a server flag (its parser is not ``make_arg_parser``'s).
        """
        values = {**flag_values(cls, args), "disable_log_stats": args.disable_log_stats}
        return cls(**{**values, **overrides})


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


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``pagedllm`` command (sets ``func`` to ``main``)."""
    parser = subparsers.add_parser(
        "serve",
        usage="%(prog)s [MODEL] [options]",
        help="Start the OpenAI-compatible HTTP server.",
        description="Start an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
        "/v1/models, /tokenize, /detokenize, /health, /version, /metrics). Flags follow vLLM's.",
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
    for name in API_KEY_ENV_VARS:
        if os.environ.get(name):
            return [os.environ[name]]
    return None


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """The server's ``EngineArgs`` of the parsed flags: every engine flag, and
    ``usage_context`` "api_server".

    Raises:
        ValueError: a flag missing from ``args``, or a bad value (see ``EngineArgs``).
    """
    return EngineArgs.from_cli_args(args, usage_context="api_server")


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


def _exit_on_sigterm(signum: int, _: Any) -> NoReturn:
    raise SystemExit(0)


def main(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM or the engine's death; returns the exit code.

    Exit codes: 0 after a shutdown by SIGINT/SIGTERM, 2 for a bad flag value (one line on
    stderr), 1 when the port is in use (one line, before the model loads), when the engine
    cannot start for another reason, or when it died while serving (so that a supervisor
    restarts the server, as vLLM).
    """
    args.model = args.model_tag or args.model
    args.api_key = resolve_api_key(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if args.model is None:
        from pagedllm.model_paths import default_model_path

        if not (default_model_path() / "config.json").is_file():
            return _fail(f"no MODEL given, and the shipped default model is missing from {default_model_path()}.", 2)
    try:
        from pagedllm.metrics.loggers import log_stats_interval

        log_stats_interval()
        if args.lora_modules and not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora.")
        check_tool_calling_args(args)
        engine_args = engine_args_from(args)
        frontend = FrontendConfig.from_cli_args(args)
        _fetch_models(engine_args)
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
        return asyncio.run(_serve(frontend, engine_args, sock))
    except KeyboardInterrupt:
        return 0
    finally:
        sock.close()


async def _serve(frontend: FrontendConfig, engine_args: EngineArgs, sock: socket.socket) -> int:
    # NOTE: start-up order: the engine process starts first (it imports torch and loads
    # the model on its own), then this process imports torch/transformers/FastAPI,
    # resolves and checks the configuration and loads the tokenizer meanwhile.
    from pagedllm.engine.core_client import EngineCoreClient

    # one engine-core process, or one per data-parallel replica (``-dp``)
    engine_core = EngineCoreClient.make_client(engine_args, multiprocess=True, asyncio_mode=True, wait_for_ready=False)
    try:
        import uvicorn

        from pagedllm.engine.async_llm import AsyncLLM
        from pagedllm.entrypoints.openai.api_server import build_app
        from pagedllm.entrypoints.chat_utils import load_chat_template
        from pagedllm.entrypoints.openai.launcher import serve_http

        frontend = dataclasses.replace(frontend, chat_template=load_chat_template(frontend.chat_template))
        served_name = (frontend.served_model_name or [None])[0]
        engine = AsyncLLM.from_engine_args(
            engine_args,
            log_requests=not frontend.disable_log_requests,
            served_model_name=served_name,
            engine_core=engine_core,
        )
    except (ValueError, OSError) as exc:  # OSError: a model directory without a usable config.json
        engine_core.shutdown(timeout_s=0)
        return _fail(str(exc), 2)
    except Exception as exc:  # EngineStartupError and friends: one line, not a traceback
        logging.getLogger(__name__).debug("Engine start-up failed", exc_info=True)
        return _fail(f"the engine failed to start: {exc}", 1)
    try:
        try:
            app = build_app(engine, frontend)
        except (ValueError, OSError) as exc:  # a --lora-modules adapter that cannot be served
            return _fail(str(exc), 2)
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
        return await serve_http(config, engine, sock, frontend.shutdown_timeout)
    finally:
        engine.shutdown()
