"""Every environment variable pagedllm reads, declared once: its name, vLLM's name for it where
pagedllm honours that too, its kind, its default and what it does.

Read a variable through its declaration, ``envs.PAGEDLLM_CPU_ISA.get()``: each call reads
``os.environ`` afresh (a few dict lookups, no cache), so a module that reads once at load
stays once-at-load and a test's ``monkeypatch.setenv`` is seen by the next call.

How a value is read, by kind:

- ``bool``: one rule for every switch. ``1``, ``true``, ``yes``, ``on`` are true; ``0``,
  ``false``, ``no``, ``off`` and the empty string are false (case and surrounding spaces
  ignored); anything else is a ``ValueError`` naming the variable. Unset: the default. A switch
  with a vLLM name is on when either name turns it on.
- ``str``: the value as set (an API key may hold spaces); empty counts as unset.
- ``choice``: one of ``choices``, case and surrounding spaces ignored; blank counts as unset;
  another word is a ``ValueError`` naming the variable.
- ``int`` / ``float``: a number (surrounding spaces ignored); blank counts as unset;
  ``nonpositive`` says what a value <= 0 (or NaN) is: ``"ok"``, ``"error"``, or ``"unset"``.

Where a variable has vLLM's name as ``alias``, pagedllm's own name is read first: the first one
set (as above) gives the value. This module imports only the standard library (it is read at
``import pagedllm``, before torch). ``tools/write_environment_doc.py`` writes docs/environment.md
from ``markdown_page()``; ``help_epilog()`` is the same list for ``--help``.
"""

from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")
KINDS = ("bool", "int", "float", "str", "choice")
_UNSET = object()
_INT = re.compile(r"[+-]?[0-9]+")


def parse_bool(name: str, value: str) -> bool:
    """``value`` of the variable ``name`` as a switch (see the module docstring).

    Raises:
        ValueError: a word of neither ``TRUE_WORDS`` nor ``FALSE_WORDS``, naming ``name``.
    """
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean: use 1, true, yes or on (or 0, false, no, off).")


class Setting(NamedTuple):
    """The variable that gave a value: its ``name`` (pagedllm's or vLLM's), the ``text`` as set
    and the parsed ``value``."""

    name: str
    text: str
    value: Any


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: ``name``; vLLM's ``alias`` (read second) or None; ``kind``, one
    of ``KINDS``; ``default``, the value when unset; ``doc``, one line; ``choices`` of a
    "choice"; ``nonpositive`` of an "int" / "float"; ``error``, the message for a bad value
    (``str.format`` fields ``name`` and ``value``; empty: the kind's own).
    """

    name: str
    kind: str
    default: Any
    doc: str
    alias: Optional[str] = None
    choices: tuple[str, ...] = ()
    nonpositive: str = "ok"
    error: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}.")
        if (self.kind == "choice") != bool(self.choices):
            raise ValueError(f"{self.name}: choices go with kind 'choice' (and it needs some).")
        if self.nonpositive not in ("ok", "error", "unset"):
            raise ValueError(f"{self.name}: nonpositive must be 'ok', 'error' or 'unset', got {self.nonpositive!r}.")

    @property
    def names(self) -> tuple[str, ...]:
        """The names read, in order: pagedllm's, then vLLM's where there is one."""
        return (self.name,) if self.alias is None else (self.name, self.alias)

    def get(self) -> Any:
        """The value from the environment now (see the module docstring), else ``default``.

        Raises:
            ValueError: a bad value, naming the variable that holds it.
        """
        setting = self.lookup()
        return self.default if setting is None else setting.value

    def lookup(self) -> Optional[Setting]:
        """The ``Setting`` that gives the value now, or None where none is set (``default``).

        Raises:
            ValueError: as ``get``.
        """
        if self.kind == "bool":
            return self._lookup_switch()
        for name, text in self._texts():
            value = self._parse(name, text)
            if value is not _UNSET:
                return Setting(name, text, value)
        return None

    def _lookup_switch(self) -> Optional[Setting]:
        found = [Setting(name, text, parse_bool(name, text)) for name, text in self._texts()]
        return next((setting for setting in found if setting.value), found[0] if found else None)

    def _texts(self) -> list[tuple[str, str]]:
        return [(name, os.environ[name]) for name in self.names if name in os.environ]

    def _parse(self, name: str, text: str) -> Any:
        if self.kind == "str":
            return text if text else _UNSET
        word = text.strip()
        if not word:
            return _UNSET
        if self.kind == "choice":
            word = word.lower()
            if word not in self.choices:
                raise self._bad(name, word, f"{{name}}={{value!r}}: use {_either(self.choices)}.")
            return word
        number = _number(self.kind, word)
        if number is None:
            raise self._bad(name, word, f"{{name}}={{value!r}} must be {_a_number(self.kind, self.nonpositive == 'error')}.")
        if not number > 0 and self.nonpositive != "ok":
            if self.nonpositive == "unset":
                return _UNSET
            raise self._bad(name, word, f"{{name}}={{value!r}} must be {_a_number(self.kind, True)}.")
        return number

    def _bad(self, name: str, value: str, default_message: str) -> ValueError:
        return ValueError((self.error or default_message).format(name=name, value=value))


def _number(kind: str, word: str) -> Optional[float]:
    if kind == "int":
        return int(word) if _INT.fullmatch(word) else None
    try:
        return float(word)
    except ValueError:
        return None


def _a_number(kind: str, positive: bool) -> str:
    if positive:
        return "a positive integer" if kind == "int" else "a positive number"
    return "an integer" if kind == "int" else "a number"


def _either(words: tuple[str, ...]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


VARIABLES: list[EnvVar] = []
"""Every declaration, in the order of docs/environment.md."""


def _declare(*args: Any, **kwargs: Any) -> EnvVar:
    variable = EnvVar(*args, **kwargs)
    VARIABLES.append(variable)
    return variable


# --- server and engine -------------------------------------------------------------------
PAGEDLLM_API_KEY = _declare(
    "PAGEDLLM_API_KEY", "str", None, "Key clients must send when `--api-key` is not given.",
    alias="VLLM_API_KEY",
)  # fmt: skip
PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING = _declare(
    "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "bool", False,
    "Serve /v1/load_lora_adapter and /v1/unload_lora_adapter.",
    alias="VLLM_ALLOW_RUNTIME_LORA_UPDATING",
)  # fmt: skip
PAGEDLLM_LOG_STATS_INTERVAL = _declare(
    "PAGEDLLM_LOG_STATS_INTERVAL", "float", 10.0, "Seconds between two stats lines of the server's log.",
    alias="VLLM_LOG_STATS_INTERVAL", nonpositive="error",
    error="{name} must be a positive number of seconds, got {value!r}.",
)  # fmt: skip
PAGEDLLM_LOGGING_LEVEL = _declare(
    "PAGEDLLM_LOGGING_LEVEL", "str", "INFO", "Level of the `pagedllm` logger (DEBUG, INFO, WARNING, ERROR).",
)  # fmt: skip
PAGEDLLM_PRELOAD_DIR = _declare(
    "PAGEDLLM_PRELOAD_DIR", "str", "/dev/shm/pagedllm-preload",
    "Folder of `pagedllm preload`'s weight stores and control socket (`--load-format ipc_cache` maps them).",
)  # fmt: skip
PAGEDLLM_SNAPSHOT_DIR = _declare(
    "PAGEDLLM_SNAPSHOT_DIR", "str", "~/.cache/pagedllm/snapshots", "Folder of `pagedllm snapshot`'s snapshots.",
)  # fmt: skip
PAGEDLLM_BATCH_INVARIANT = _declare(
    "PAGEDLLM_BATCH_INVARIANT", "bool", False, "Turn `--batch-invariant` on.",
    alias="VLLM_BATCH_INVARIANT",
)  # fmt: skip
PAGEDLLM_ATTENTION_BACKEND = _declare(
    "PAGEDLLM_ATTENTION_BACKEND", "str", None,
    "Attention backend when `--attention-backend` is not given (CPU_ATTN, TORCH_SDPA, ...); unset: by platform.",
)  # fmt: skip
PAGEDLLM_CPU_KVCACHE_SPACE = _declare(
    "PAGEDLLM_CPU_KVCACHE_SPACE", "float", None,
    "KV-cache size on CPU in GiB; 0 or unset: what the configuration can use.",
    alias="VLLM_CPU_KVCACHE_SPACE", nonpositive="unset", error="{name} must be a number of GiB, got {value!r}.",
)  # fmt: skip
# --- worker processes and parallelism ---------------------------------------------------
PAGEDLLM_WORKER_MULTIPROC_METHOD = _declare(
    "PAGEDLLM_WORKER_MULTIPROC_METHOD", "choice", None,
    "How child processes start; unset: fork where the OS has it, else spawn.",
    alias="VLLM_WORKER_MULTIPROC_METHOD", choices=("fork", "spawn"),
)  # fmt: skip
PAGEDLLM_CPU_OMP_THREADS_BIND = _declare(
    "PAGEDLLM_CPU_OMP_THREADS_BIND", "str", "auto",
    "Cores of each worker: auto (split this process's cores), nobind, or one list per worker ('0-3|4-7').",
)  # fmt: skip
PAGEDLLM_CPU_COLLECTIVES = _declare(
    "PAGEDLLM_CPU_COLLECTIVES", "choice", None,
    "Collectives of the CPU ranks of one machine; unset: shm on x86-64, gloo elsewhere.",
    choices=("shm", "gloo"),
)  # fmt: skip
PAGEDLLM_PP_LAYER_PARTITION = _declare(
    "PAGEDLLM_PP_LAYER_PARTITION", "str", None,
    "Decoder layers per pipeline stage, comma-separated ('10,14'); unset: an even split.",
)  # fmt: skip
PAGEDLLM_PP_MAX_CONCURRENT_BATCHES = _declare(
    "PAGEDLLM_PP_MAX_CONCURRENT_BATCHES", "int", None,
    "Steps in flight with pipeline parallelism, at most one per stage; unset: one per stage.",
    nonpositive="error", error="{name}={value!r} must be a positive integer (steps in flight).",
)  # fmt: skip
PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S = _declare(
    "PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S", "float", 60.0,
    "Seconds the Ray executor waits for the cluster to host its workers (read at import).",
)  # fmt: skip
# --- images in chat requests -------------------------------------------------------------
PAGEDLLM_IMAGE_FETCH_TIMEOUT = _declare(
    "PAGEDLLM_IMAGE_FETCH_TIMEOUT", "float", 5.0, "Seconds an http(s) image URL of a chat request may take to fetch.",
    alias="VLLM_IMAGE_FETCH_TIMEOUT", nonpositive="error",
    error="{name} must be a positive number of seconds, got {value!r}.",
)  # fmt: skip
PAGEDLLM_MAX_IMAGE_BYTES = _declare(
    "PAGEDLLM_MAX_IMAGE_BYTES", "int", 20 << 20, "Largest image (bytes) a chat request's image URL may bring.",
    nonpositive="error", error="{name} must be a positive number of bytes, got {value!r}.",
)  # fmt: skip
PAGEDLLM_VIDEO_FETCH_TIMEOUT = _declare(
    "PAGEDLLM_VIDEO_FETCH_TIMEOUT", "float", 30.0, "Seconds an http(s) video URL of a chat request may take to fetch.",
    alias="VLLM_VIDEO_FETCH_TIMEOUT", nonpositive="error",
    error="{name} must be a positive number of seconds, got {value!r}.",
)  # fmt: skip
PAGEDLLM_MAX_VIDEO_BYTES = _declare(
    "PAGEDLLM_MAX_VIDEO_BYTES", "int", 100 << 20, "Largest video (bytes) a chat request's video URL may bring.",
    nonpositive="error", error="{name} must be a positive number of bytes, got {value!r}.",
)  # fmt: skip

# --- CPU kernels --------------------------------------------------------------------------
PAGEDLLM_CPU_ISA = _declare(
    "PAGEDLLM_CPU_ISA", "str", None,
    "Run the CPU kernels (and cap oneDNN, ATen, MKL) at this level, at most the CPU's: portable, avx2, avx512, avx512_bf16.",
)  # fmt: skip
PAGEDLLM_DISABLE_CPU_KERNELS = _declare(
    "PAGEDLLM_DISABLE_CPU_KERNELS", "bool", False,
    "Use the portable PyTorch code instead of the C++ CPU kernels and oneDNN packing.",
)  # fmt: skip
PAGEDLLM_CPU_INT8_ACTIVATIONS = _declare(
    "PAGEDLLM_CPU_INT8_ACTIVATIONS", "bool", True,
    "Quantize decode activations to int8 for int8/int4/GGUF weights on CPU (read at load).",
)  # fmt: skip
PAGEDLLM_CPU_FP32_WEIGHT_COPY = _declare(
    "PAGEDLLM_CPU_FP32_WEIGHT_COPY", "choice", "auto",
    "Float32 copies of 16-bit weights for prefill: auto (while a quarter of the free memory lasts), 1, 0.",
    choices=("auto", "0", "1"),
)  # fmt: skip


def _kind_text(variable: EnvVar) -> str:
    return " / ".join(variable.choices) if variable.kind == "choice" else variable.kind


def _default_text(variable: EnvVar) -> str:
    if variable.default is None:
        return "unset"
    if variable.kind == "bool":
        return "1" if variable.default else "0"
    if variable.kind == "float" and float(variable.default).is_integer():
        return str(int(variable.default))
    return str(variable.default)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_page() -> str:
    """The text of docs/environment.md: a table of ``VARIABLES``."""
    rows = [
        f"| `{v.name}` | {f'`{v.alias}`' if v.alias else ''} | {_kind_text(v)} | `{_default_text(v)}` | {_cell(v.doc)} |"
        for v in VARIABLES
    ]
    return "\n".join([
        "# Environment variables",
        "",
        "<!-- Written by tools/write_environment_doc.py from pagedllm/envs.py; "
        "tests/test_envs.py fails when it is out of date. -->",
        "",
        "Every variable pagedllm reads. Where vLLM has the same variable, its name works too; "
        "pagedllm's is read first. Switches (bool) take 1, true, yes, on or 0, false, no, off "
        "(any case); another value is an error naming the variable. A switch with a vLLM name "
        "is on when either name turns it on. An empty value counts as unset (a switch: off). "
        "Variables of the libraries pagedllm runs on (`HF_TOKEN`, `HF_HUB_OFFLINE`, "
        "`CUDA_VISIBLE_DEVICES`, `OMP_NUM_THREADS`, `PYTHONHASHSEED`, ...) keep their own meaning; "
        "at import pagedllm sets `THP_MEM_ALLOC_ENABLE=1` and, under `PAGEDLLM_CPU_ISA`, the "
        "libraries' ISA caps, each only where unset (`pagedllm/env_override.py`).",
        "",
        "| variable | vLLM's name | kind | default | what it does |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
    ])  # fmt: skip


def help_epilog(width: int = 100) -> str:
    """The "Environment variables:" text for the end of ``pagedllm serve --help``: each variable
    (and vLLM's name) on a line, its doc and default indented below, wrapped at ``width``
    columns. Keep its line breaks (``argparse.RawDescriptionHelpFormatter``)."""
    lines = ["Environment variables:"]
    for v in VARIABLES:
        lines.append("  " + ", ".join(v.names))
        lines += textwrap.wrap(f"{v.doc.replace('`', '')} ({_kind_text(v)}, default: {_default_text(v)})", width,
                               initial_indent=" " * 6, subsequent_indent=" " * 6)  # fmt: skip
    return "\n".join(lines)
