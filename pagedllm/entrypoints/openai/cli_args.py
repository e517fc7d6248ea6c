"""``pagedllm serve [MODEL] [flags]``: flags with vLLM's names and meanings, and ``main``.

A bad flag value is one line on stderr (``pagedllm serve: error: ...``) and exit code 2,
never a traceback. Sizes take human-readable values as vLLM: ``8192``, ``32k`` (x1000),
``32K`` (x1024), ``1M`` (x1024^2), ``25.6k``.

vLLM's common flags are all accepted (``_add_vllm_server_flags``, ``_add_vllm_engine_flags``):
they act as in vLLM, are documented no-ops where they cannot matter, or, for a value asking
for something not built, fail at once with "... is not supported yet". ``--config
FILE.yaml``, ``--flag_with_underscores`` and "did you mean" for a misspelled flag: see
``pagedllm.entrypoints.arg_parsing``.

Module import stays light (argparse only): the engine, FastAPI and uvicorn are imported
by ``main``.
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
from typing import Any, Callable, NoReturn, Optional

from pagedllm import envs
from pagedllm.entrypoints.arg_parsing import CONFIG_FLAG, make_flexible

#: Environment variables read (in this order) when ``--api-key`` is not given.
API_KEY_ENV_VARS = envs.PAGEDLLM_API_KEY.names

_SUFFIXES = {
    "": 1,
    "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
    "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4,
}  # fmt: skip
_HUMAN_INT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)\s*")

_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash")
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

# Defaults shown in --help; they equal EngineArgs' (kept here so --help imports no torch).
_DEFAULT_BLOCK_SIZE = 16
_DEFAULT_MAX_NUM_SEQS = 256
_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
#: ``--shutdown-timeout``: seconds running requests may take to finish on SIGTERM / Ctrl-C.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


def human_readable_int(value: str) -> int:
    """``"8192"`` -> 8192, ``"32k"`` -> 32000, ``"32K"`` -> 32768, ``"1M"`` -> 1048576.

    Lower-case suffixes are powers of 1000 and upper-case ones powers of 1024 (vLLM's
    convention); a fraction is allowed when the result is a whole number.

    Raises:
        argparse.ArgumentTypeError: anything else, or a result below 1.
    """
    match = _HUMAN_INT.fullmatch(value)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid value {value!r}: expected a positive integer, optionally with a suffix "
            f"k/m/g (x1000) or K/M/G (x1024), e.g. 8192, 32k, 1M"
        )
    number, suffix = match.groups()
    multiplier = _SUFFIXES[suffix]
    if "." in number:
        whole, fraction = number.split(".")
        numerator = int(whole + fraction) * multiplier
        denominator = 10 ** len(fraction)
        if numerator % denominator:
            raise argparse.ArgumentTypeError(f"invalid value {value!r}: it is not a whole number of tokens/bytes")
        result = numerator // denominator
    else:
        result = int(number) * multiplier
    if result < 1:
        raise argparse.ArgumentTypeError(f"invalid value {value!r}: must be at least 1")
    return result


def max_model_len_type(value: str) -> Optional[int]:
    """``--max-model-len``: a human-readable int, or ``auto`` / ``-1`` for the model's own."""
    if value.strip().lower() in ("auto", "-1"):
        return None
    return human_readable_int(value)


def _checked(value: str, cast: Callable[[str], Any], expected: str, ok: Callable[[Any], bool]) -> Any:
    """``cast(value)`` when it converts and passes ``ok``, else "invalid value ...: expected ..."."""
    try:
        result = cast(value)
    except ValueError:
        result = None
    if result is None or not ok(result):
        raise argparse.ArgumentTypeError(f"invalid value {value!r}: expected {expected}")
    return result


def positive_int(value: str) -> int:
    return _checked(value, int, "a positive integer", lambda n: n >= 1)


def port_type(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {value!r}: expected an integer in [0, 65535]") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {value!r}: expected an integer in [0, 65535]")
    return port


def fraction_type(value: str) -> float:
    return _checked(value, float, "a number in (0, 1]", lambda x: 0.0 < x <= 1.0)


def non_negative_seconds(value: str) -> float:
    try:
        result = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {value!r}: expected a number of seconds") from None
    if not 0.0 <= result < float("inf"):
        raise argparse.ArgumentTypeError(f"invalid value {value!r}: expected a number of seconds >= 0")
    return result


def int_type(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {value!r}: expected an integer") from None


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help when X says something (not None/False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS) or "default" in help_text.lower():
            return help_text
        return f"{help_text} (default: {default})"


def json_object(value: str) -> dict:
    """A JSON object given on the command line (``'{"temperature": 0.5}'``).

    Raises:
        argparse.ArgumentTypeError: not JSON, or not an object.
    """
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON {value!r}: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"invalid value {value!r}: expected a JSON object")
    return parsed


def _one_line_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``serve`` flags to ``parser`` and make its errors one line (exit code 2)."""
    parser.error = types.MethodType(_one_line_error, parser)  # type: ignore[method-assign]
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL",
        help="Model directory (Hugging Face layout) or a Hugging Face Hub id, downloaded on first use "
        "(HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE are honoured). Default: the small model shipped with pagedllm.",
    )  # fmt: skip
    parser.add_argument("--model", default=None, help="Same as MODEL (vLLM's older form).")
    parser.add_argument("--tokenizer", default=None, help="Tokenizer directory or Hub id (default: the model's).")
    parser.add_argument("--revision", default=None, help="Model revision on the Hub: branch, tag or commit (default: main).")
    parser.add_argument("--tokenizer-revision", default=None, help="Tokenizer revision on the Hub (default: main).")
    parser.add_argument(
        "--download-dir", default=None,
        help="Directory for downloaded models (default: the Hugging Face cache, $HF_HOME/hub).",
    )  # fmt: skip

    server = parser.add_argument_group("server")
    server.add_argument(
        "--host", default="127.0.0.1",
        help="Address to listen on. Use --host 0.0.0.0 to listen on all interfaces.",
    )  # fmt: skip
    server.add_argument("--port", type=port_type, default=8000, help="Port to listen on.")
    server.add_argument(
        "--served-model-name", nargs="+", default=None, metavar="NAME",
        help="Model name(s) clients use in the 'model' field; the first is the one reported. "
        "Default: MODEL as given (the shipped model: pagedllm-default).",
    )  # fmt: skip
    server.add_argument(
        "--chat-template", default=None,
        help="Chat template for /v1/chat/completions: a file path, or the Jinja template itself. "
        "Default: the tokenizer's.",
    )  # fmt: skip
    server.add_argument(
        "--api-key", default=None, nargs="+", metavar="KEY",
        help="Require 'Authorization: Bearer <key>', with one of these keys, on every route except /health "
        f"and /metrics. Also read from ${API_KEY_ENV_VARS[0]}, then ${API_KEY_ENV_VARS[1]} (one key).",
    )  # fmt: skip
    server.add_argument("--disable-log-requests", action="store_true", help="Do not log each request.")
    server.add_argument(
        "--uvicorn-log-level", default="info", choices=_LOG_LEVELS, help="Log level of the HTTP server (uvicorn)."
    )
    server.add_argument("--disable-uvicorn-access-log", action="store_true", help="Do not log each HTTP access.")
    server.add_argument(
        "--disable-log-stats", action="store_true",
        help="Do not log the engine's statistics line (throughput, running and waiting requests, KV-cache "
        "usage, prefix-cache hit rate) every $PAGEDLLM_LOG_STATS_INTERVAL seconds (default 10) while it works.",
    )  # fmt: skip
    server.add_argument(
        "--shutdown-timeout", type=non_negative_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
        help="On SIGTERM or Ctrl-C, stop accepting connections and let running requests finish for up to this "
        "many seconds; then end each open stream with an error event and [DONE].",
    )  # fmt: skip

    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--dtype", default="auto", choices=_DTYPES,
        help="Compute dtype. 'auto': the checkpoint's, with float32 (and float16 on CPU) turned into the "
        "platform's 16-bit type.",
    )  # fmt: skip
    engine.add_argument(
        "--max-model-len", type=max_model_len_type, default=None,
        help="Context length in tokens (prompt + output), e.g. 8192, 32k (=32000), 32K (=32768), 1M. "
        "Default: the model's max_position_embeddings.",
    )  # fmt: skip
    engine.add_argument(
        "--block-size", type=int_type, default=_DEFAULT_BLOCK_SIZE, choices=(8, 16, 32),
        help="Tokens per KV-cache block.",
    )  # fmt: skip
    engine.add_argument(
        "--max-num-seqs", type=positive_int, default=_DEFAULT_MAX_NUM_SEQS,
        help="Most requests running at once.",
    )  # fmt: skip
    engine.add_argument(
        "--max-num-batched-tokens", type=human_readable_int, default=None,
        help="Token budget of one engine step (default, as vLLM: 2048 on CPU, 8192 on GPU, at least --max-num-seqs).",
    )  # fmt: skip
    engine.add_argument(
        "--gpu-memory-utilization", type=fraction_type, default=_DEFAULT_GPU_MEMORY_UTILIZATION,
        help="Fraction of device memory (on CPU: of the RAM available at start-up) for weights, "
        "activations and KV cache.",
    )  # fmt: skip
    engine.add_argument(
        "--kv-cache-memory-bytes", type=human_readable_int, default=None,
        help="Exact KV-cache size in bytes (e.g. 512M, 4G); overrides --gpu-memory-utilization.",
    )  # fmt: skip
    engine.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="Automatic prefix caching: reuse the KV cache of shared prompt prefixes.",
    )  # fmt: skip
    engine.add_argument(
        "--prefix-caching-hash-algo", default="sha256", choices=_HASH_ALGOS,
        help="Hash of prefix-cache blocks: sha256 (default), sha256_cbor, or xxhash (faster, not "
        "cryptographic).",
    )  # fmt: skip
    engine.add_argument(
        "--attention-backend", default=None, metavar="NAME",
        help="Attention backend: CPU_ATTN (C++ CPU kernel), TORCH_SDPA (portable PyTorch) or a registered "
        "one. Default: $PAGEDLLM_ATTENTION_BACKEND, else chosen by platform.",
    )  # fmt: skip
    engine.add_argument("--seed", type=int_type, default=0, help="Global random seed.")
    engine.add_argument(
        "--quantization", "-q", default=None,
        help="Weight format. Quantize a 16/32-bit checkpoint at load: int8 = weight-only int8, one scale "
        "per output channel (half the bytes of bf16 per decode step); int4 = weight-only 4-bit, symmetric "
        "groups of 32 as llama.cpp's Q4_0 (a quarter; --quantization-config for 128); fp8 = e4m3 weights, one scale per tensor (vLLM's online FP8). Checkpoint "
        "formats, read from config.json (naming one here checks it): gptq, awq, compressed-tensors (W4A16 / W8A16 "
        "pack-quantized), fp8; a .gguf MODEL is read as gguf. "
        "Default: the checkpoint's own format.",
    )  # fmt: skip
    engine.add_argument(
        "--quantization-config", type=json_object, default=None, metavar="JSON",
        help="Options of a --quantization applied at load, as JSON (vLLM's quantization_config): int4 reads "
        "'{\"group_size\": 128}' (32, 64 or 128; default 32).",
    )  # fmt: skip
    engine.add_argument(
        "--generation-config", default="auto", metavar="{auto,vllm,FOLDER}",
        help="Default sampling parameters of requests that do not set them: 'auto' takes the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), "
        "'vllm' uses vLLM's defaults, a FOLDER reads its generation_config.json (its max_new_tokens also "
        "caps every request).",
    )  # fmt: skip
    engine.add_argument(
        "--override-generation-config", type=json_object, default=None, metavar="JSON",
        help="Sampling defaults that replace the generation config's, e.g. '{\"temperature\": 0.5}' "
        "(same fields as --generation-config).",
    )  # fmt: skip
    _add_vllm_server_flags(server)
    _add_vllm_engine_flags(engine)
    make_flexible(parser)
    return parser


class _NotBuilt(argparse.Action):
    """A vLLM flag for a feature not built yet: giving it is a one-line error (exit 2)."""

    def __init__(self, option_strings: list[str], dest: str, why: str, nargs: Any = None, **kwargs: Any) -> None:
        super().__init__(
            option_strings, dest, nargs=nargs, default=argparse.SUPPRESS, help=f"Not supported yet: {why}.", **kwargs
        )
        self.why = why

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        parser.error(f"{option_string} is not supported yet ({self.why}).")


def json_list_type(value: str) -> list[str]:
    """``--allowed-origins`` and friends: a JSON list of strings (vLLM's form), or one bare string."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return [value]
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise argparse.ArgumentTypeError(f"invalid value {value!r}: expected a JSON list of strings, e.g. '[\"*\"]'")
    return parsed


def json_object_type(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"invalid value {value!r}: expected a JSON object")
    return parsed


def lora_module_type(value: str) -> dict[str, Any]:
    """One ``--lora-modules`` item (vLLM's forms): ``name=path`` or a JSON object with
    ``name``, ``path`` and optionally ``base_model_name`` -> that dict."""
    if value.lstrip().startswith("{"):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str) or not isinstance(parsed.get("path"), str):
            raise argparse.ArgumentTypeError(
                f"invalid LoRA module {value!r}: expected a JSON object with string 'name' and 'path'"
            )
        return {"name": parsed["name"], "path": parsed["path"], "base_model_name": parsed.get("base_model_name")}
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"invalid LoRA module {value!r}: expected name=path or a JSON object")
    return {"name": name, "path": path, "base_model_name": None}


def non_negative_float(value: str) -> float:
    return _checked(value, float, "a number >= 0", lambda x: x >= 0)


def _add_vllm_server_flags(server: Any) -> None:
    """vLLM's other ``vllm serve`` flags (names and defaults as vLLM's ``FrontendArgs``)."""
    server.add_argument(
        CONFIG_FLAG, default=None, metavar="FILE.yaml",
        help="Read flags from a YAML file: keys are flag names without the leading dashes (e.g. "
        "'tensor-parallel-size: 1'); flags on the command line win over the file.",
    )  # fmt: skip
    server.add_argument(
        "--uds", default=None, metavar="PATH", help="Listen on this Unix domain socket instead of --host/--port."
    )
    server.add_argument("--root-path", default=None, help="FastAPI root_path, for a server behind a path-based proxy.")
    server.add_argument("--ssl-keyfile", default=None, help="TLS: the server's private key file (PEM).")
    server.add_argument("--ssl-certfile", default=None, help="TLS: the server's certificate file (PEM); serves HTTPS.")
    server.add_argument("--ssl-ca-certs", default=None, help="TLS: CA certificates to check client certificates.")
    server.add_argument(
        "--ssl-cert-reqs", type=int_type, default=0,
        help="TLS: whether client certificates are required (Python's ssl.CERT_NONE=0, CERT_OPTIONAL=1, "
        "CERT_REQUIRED=2).",
    )  # fmt: skip
    for name, what in (("origins", "Origins"), ("methods", "HTTP methods"), ("headers", "Request headers")):
        server.add_argument(
            f"--allowed-{name}", type=json_list_type, default=["*"],
            help=f"CORS: {what} allowed, as a JSON list, e.g. '[\"https://a.example\"]'.",
        )  # fmt: skip
    server.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies).")
    server.add_argument(
        "--response-role", default="assistant",
        help="Role of the reply in chat completions when add_generation_prompt is true.",
    )  # fmt: skip
    server.add_argument(
        "--return-tokens-as-token-ids", action="store_true",
        help="Logprobs name tokens 'token_id:{id}' instead of their text.",
    )  # fmt: skip
    server.add_argument(
        "--enable-log-requests", action="store_true",
        help="Log each request: pagedllm does so unless --disable-log-requests is given.",
    )  # fmt: skip
    _add_tool_calling_flags(server)
    server.add_argument("--reasoning-parser", action=_NotBuilt, why="reasoning parsers are not built")
    server.add_argument(
        "--lora-modules", type=lora_module_type, nargs="+", default=None, metavar="name=path | JSON",
        help="LoRA adapters to serve (with --enable-lora), each 'name=path' or a JSON object "
        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a request selects one by its name in 'model'.",
    )  # fmt: skip


def _add_tool_calling_flags(server: Any) -> None:
    """vLLM's tool-calling flags (checked by ``check_tool_calling_args`` before the engine starts)."""
    from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager

    server.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="Chat requests may use tool_choice \"auto\": the model's calls are read from its text by "
        "--tool-call-parser.",
    )  # fmt: skip
    server.add_argument(
        "--tool-call-parser", default=None, metavar="{" + ",".join(ToolParserManager.names()) + "}",
        help="The format of the model's tool calls, for --enable-auto-tool-choice.",
    )  # fmt: skip


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


def _add_vllm_engine_flags(engine: Any) -> None:
    """vLLM's other engine flags (names and defaults as vLLM's ``EngineArgs``). A value that
    asks for something not built is refused by ``EngineArgs`` ("... is not supported yet")."""
    engine.add_argument(
        "--tensor-parallel-size", "-tp", type=positive_int, default=1,
        help="Worker processes the model's layers are split over (tensor parallelism): one GPU each on CUDA, "
        "at least one core each on CPU.",
    )
    engine.add_argument(
        "--pipeline-parallel-size", "-pp", type=positive_int, default=1,
        help="Pipeline stages the model's layers are split over, one worker process each (x the tensor-parallel "
        "size); at most the model's number of layers.",
    )
    engine.add_argument(
        "--data-parallel-size", "-dp", type=positive_int, default=1,
        help="Engine replicas behind this server, each in its own process (on CPU: its own share of the cores; on "
        "CUDA: its own device; with -tp/-pp: its own workers, -dp x -tp x -pp in all); requests go to the least "
        "loaded one.",
    )  # fmt: skip
    engine.add_argument(
        "--distributed-executor-backend", default=None, choices=("ray", "mp", "uni", "external_launcher"),
        help="How workers run: 'uni' (one worker in the engine process; the default for one worker), 'mp' "
        "(one process per worker on this machine; the default for more) or 'ray' (one Ray actor per worker on the "
        "nodes of a Ray cluster, `ray start`; the default when Ray is connected); 'external_launcher' is not "
        "supported yet.",
    )  # fmt: skip
    engine.add_argument(
        "--trust-remote-code", action="store_true",
        help="Let transformers run a checkpoint's own config code. The model must still be one of pagedllm's "
        "architectures.",
    )  # fmt: skip
    engine.add_argument(
        "--tokenizer-mode", default="auto", choices=("auto", "hf", "slow", "mistral", "custom"),
        help="'auto' / 'hf': the Hugging Face fast tokenizer; the others are not supported yet.",
    )  # fmt: skip
    engine.add_argument(
        "--load-format", default="auto",
        choices=("auto", "safetensors", "pt", "npcache", "dummy", "tensorizer", "sharded_state", "gguf",
                 "bitsandbytes", "mistral", "runai_streamer", "fastsafetensors"),
        help="Checkpoint format: 'auto' / 'safetensors' (*.safetensors), 'gguf' (a .gguf MODEL, also read under "
        "'auto'); the others are not supported yet.",
    )  # fmt: skip
    engine.add_argument(
        "--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"),
        help="KV-cache dtype: 'auto' (the model's dtype), or FP8 ('fp8' = 'fp8_e4m3', 'fp8_e5m2'): one byte "
        "per element, twice the tokens of a 16-bit cache in the same memory, scaled by the checkpoint's "
        "k_scale / v_scale (else 1.0); 'bfloat16' and 'fp8_inc' are not supported yet.",
    )  # fmt: skip
    engine.add_argument(
        "--calculate-kv-scales", action="store_true",
        help="With an FP8 KV cache: compute each layer's k_scale / v_scale from the first batch "
        "(amax / 200 for keys, amax / 100 for values, as vLLM) instead of the checkpoint's or 1.0.",
    )  # fmt: skip
    engine.add_argument(
        "--max-logprobs", type=int_type, default=20,
        help="Most logprobs per token a request may ask for (logprobs, top_logprobs, prompt_logprobs); "
        "-1: the vocabulary size. Requests asking more get a 400.",
    )  # fmt: skip
    engine.add_argument(
        "--batch-invariant", action="store_true",
        help="Logprobs bit-identical whatever the batch, chunk size, prefix-cache state and preemption "
        "(as vLLM's VLLM_BATCH_INVARIANT=1): each matmul row and each attention query computed alone, "
        "in one fixed order; slower prefill (docs/benchmarks.md). Unquantized models without LoRA or "
        "speculative decoding.",
    )  # fmt: skip
    engine.add_argument(
        "--num-gpu-blocks-override", type=positive_int, default=None,
        help="Number of KV-cache blocks, exactly (no memory sizing).",
    )  # fmt: skip
    engine.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
        help="Cut long prompts into chunks that fit --max-num-batched-tokens: always on here "
        "(--no-enable-chunked-prefill is not supported yet).",
    )  # fmt: skip
    engine.add_argument("--cpu-offload-gb", type=non_negative_float, default=0, help="0 only (offloading is not supported yet).")
    engine.add_argument(
        "--enable-lora", action="store_true",
        help="Serve LoRA adapters (--lora-modules, or loaded at run time) over the base model, many in one batch.",
    )  # fmt: skip
    engine.add_argument("--max-loras", type=positive_int, default=1, help="LoRA adapters in one batch (device slots).")
    engine.add_argument("--max-lora-rank", type=positive_int, default=16, help="Largest LoRA rank served.")
    engine.add_argument(
        "--max-cpu-loras", type=positive_int, default=None,
        help="LoRA adapters kept loaded in CPU memory (LRU; default: --max-loras).",
    )  # fmt: skip
    engine.add_argument(
        "--speculative-config", type=json_object_type, default=None,
        help="Speculative decoding, as JSON (vLLM's keys): {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4} or {\"model\": DRAFT, \"num_speculative_tokens\": 4}.",
    )  # fmt: skip
    engine.add_argument(
        "--structured-outputs-config", type=json_object_type, default=None, metavar="JSON",
        help="Constrained decoding (response_format, structured_outputs, guided_*): '{\"backend\": \"auto\"}' "
        "(xgrammar, falling back to llguidance for what it cannot compile) | \"xgrammar\" | \"guidance\"; "
        "also disable_fallback, disable_any_whitespace, disable_additional_properties (true/false), "
        "max_whitespace_cnt, max_number_digits, max_string_length (bounds on JSON output; null: none).",
    )  # fmt: skip
    engine.add_argument("--enforce-eager", action="store_true", help="No-op: pagedllm captures no CUDA graphs.")
    engine.add_argument(
        "--max-seq-len-to-capture", type=positive_int, default=8192, help="No-op: pagedllm captures no CUDA graphs."
    )
    engine.add_argument(
        "--swap-space", type=non_negative_float, default=4,
        help="GiB of CPU swap space per device. No-op: preempted requests are recomputed, never swapped.",
    )  # fmt: skip
    engine.add_argument("--disable-custom-all-reduce", action="store_true", help="No-op: pagedllm has no custom CUDA all-reduce.")
    engine.add_argument(
        "--disable-sliding-window", action="store_true",
        help="Attend over the whole context in layers with a sliding window, and cap --max-model-len at the "
        "window (vLLM's behaviour). No effect on models without sliding windows.",
    )  # fmt: skip


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
    key = envs.PAGEDLLM_API_KEY.get()
    return None if key is None else [key]


def engine_args_from(args: argparse.Namespace) -> Any:
    """The ``EngineArgs`` of the parsed flags (fields matched by name)."""
    from pagedllm.config import EngineArgs

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(args, f.name)}
    return EngineArgs(**values, usage_context="api_server")


def uvicorn_tls_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's TLS settings from ``--ssl-*`` (vLLM's flags): with a certificate it serves HTTPS."""
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
        _fetch_models(engine_args)
    except ValueError as exc:
        return _fail(str(exc), 2)
    try:
        sock = bind_unix_socket(args.uds) if args.uds else bind_socket(args.host, args.port)
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
        return asyncio.run(_serve(args, engine_args, sock))
    except KeyboardInterrupt:
        return 0
    finally:
        sock.close()


async def _serve(args: argparse.Namespace, engine_args: Any, sock: socket.socket) -> int:
    # NOTE: start-up order: the engine process starts first (it imports torch and loads
    # the model on its own), then this process imports torch/transformers/FastAPI,
    # resolves and checks the configuration and loads the tokenizer meanwhile.
    from pagedllm.engine.client_factory import make_client

    # one engine-core process, or one per data-parallel replica (``-dp``)
    engine_core = make_client(engine_args, multiprocess=True, asyncio_mode=True, wait_for_ready=False)
    try:
        import uvicorn

        from pagedllm.engine.async_llm import AsyncLLM
        from pagedllm.entrypoints.openai.api_server import build_app
        from pagedllm.entrypoints.chat_utils import load_chat_template
        from pagedllm.entrypoints.openai.launcher import serve_http

        args.chat_template = load_chat_template(args.chat_template)
        served_name = (args.served_model_name or [None])[0]
        engine = AsyncLLM.from_engine_args(
            engine_args,
            log_requests=not args.disable_log_requests,
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
            app = build_app(engine, args)
        except (ValueError, OSError) as exc:  # a --lora-modules adapter that cannot be served
            return _fail(str(exc), 2)
        # NOTE: torch and transformers leave millions of long-lived objects; without this,
        # each full garbage collection pauses the event loop (and /health) for 100+ ms.
        gc.collect()
        gc.freeze()
        config = uvicorn.Config(
            app,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            **uvicorn_tls_kwargs(args),
        )
        return await serve_http(config, engine, sock, args.shutdown_timeout)
    finally:
        engine.shutdown()
