"""``FrontendConfig``: the OpenAI server's own settings, one field per ``server`` flag of
``pagedllm serve`` (vLLM's ``FrontendArgs``), declared with the flags' metadata
(``pagedllm.config.flags``). Its own module so that ``cli_args`` (the parser, ``main``) and
``api_server`` (``build_app``) both read it without importing each other. Torch-free.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional

from pagedllm import envs
from pagedllm.config.arg_types import (
    int_type,
    json_list_type,
    lora_module_type,
    non_negative_seconds,
    port_type,
    positive_int,
    positive_seconds,
)
from pagedllm.config.flags import flag_field, flag_values, not_a_flag
from pagedllm.entrypoints.chat_content_format import CHAT_TEMPLATE_CONTENT_FORMATS

#: Environment variables read (in this order) when ``--api-key`` is not given.
API_KEY_ENV_VARS = envs.PAGEDLLM_API_KEY.names

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
#: ``--shutdown-timeout``: seconds running requests may take to finish on SIGTERM / Ctrl-C.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
#: ``--grpc-port``: gRPC's customary port.
DEFAULT_GRPC_PORT = 50051


def _tool_parser_metavar() -> str:
    """``--tool-call-parser``'s metavar: the registered parsers' names."""
    from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager

    return "{" + ",".join(ToolParserManager.names()) + "}"


def _reasoning_parser_metavar() -> str:
    """``--reasoning-parser``'s metavar: the registered parsers' names."""
    from pagedllm.reasoning import ReasoningParserManager

    return "{" + ",".join(ReasoningParserManager.names()) + "}"


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
    chat_template_content_format: str = flag_field(
        "auto",
        help=(
            "How the chat template gets a message's content: 'string' (text parts joined with newlines), "
            "'openai' (a list of parts: {'type': 'text', 'text': ...}, {'type': 'image'}), or 'auto': 'openai' for "
            "a template that loops over a message's content, else 'string'. The detected format is logged at "
            "start-up."
        ),
        choices=CHAT_TEMPLATE_CONTENT_FORMATS,
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
        help=(
            "How the model writes its reasoning: chat completions (and /v1/messages) return it in "
            "'reasoning' ('thinking' blocks), apart from the content."
        ),
        metavar=_reasoning_parser_metavar,
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
    grpc: bool = flag_field(
        False,
        help=(
            "Also serve gRPC (the pagedllm.v1.Generation service: Generate, Abort, Health, ModelInfo) on "
            "--host:--grpc-port, beside HTTP and with the same engine."
        ),
        action="store_true",
    )
    grpc_port: int = flag_field(
        DEFAULT_GRPC_PORT,
        help="Port of the gRPC server (with --grpc).",
        type=port_type, metavar="PORT",
    )
    disable_frontend: bool = flag_field(
        False,
        help="Do not serve the chat page at / (the API routes are unaffected).",
        action="store_true",
    )
    max_num_queued_reqs: Optional[int] = flag_field(
        None,
        help=(
            "Most requests queued (sent to the engine, no output yet): one more is answered 429 with a "
            "Retry-After header (vLLM's name; vLLM answers 503). Default: no limit."
        ),
        type=positive_int,
    )
    max_num_queued_tokens: Optional[int] = flag_field(
        None,
        help=(
            "Most prompt tokens of queued requests, as --max-num-queued-reqs (vLLM has no such flag). "
            "Default: no limit."
        ),
        type=positive_int,
    )
    request_timeout: Optional[float] = flag_field(
        None,
        help=(
            "Seconds a request may take from receipt to its end: then it is aborted in the engine and "
            "answered 504 (streamed: an error event, then [DONE]). Default: no limit."
        ),
        type=positive_seconds, metavar="SECONDS",
    )
    calculate_kv_cache_size: bool = flag_field(
        False,
        help=(
            "Print the KV-cache size the flags give (bytes, tokens and blocks, per KV-cache group) "
            "and exit without serving."
        ),
        action="store_true",
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


