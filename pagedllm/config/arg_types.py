"""Value parsers of command-line flags (``type=`` of ``argparse``), shared by every command.

Each takes the flag's string and returns its value, or raises
``argparse.ArgumentTypeError`` with a one-line "invalid value ...: expected ..." that
argparse prints after the flag's name. Sizes are human-readable as vLLM's: ``8192``,
``32k`` (x1000), ``32K`` (x1024), ``1M`` (x1024^2), ``25.6k``. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any, Callable, Optional

_SUFFIXES = {
    "": 1,
    "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
    "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4,
}  # fmt: skip
_HUMAN_INT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)\s*")


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


def positive_seconds(value: str) -> float:
    return _checked(value, float, "a number of seconds > 0", lambda x: 0.0 < x < float("inf"))


def int_type(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {value!r}: expected an integer") from None


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


def compilation_config_type(value: str) -> dict:
    """``--compilation-config`` / ``-O``: a JSON object, or an optimization level 0-3 (vLLM's
    ``-O3``) -> ``{"level": 3}``."""
    if value.strip() in ("0", "1", "2", "3"):
        return {"level": int(value)}
    try:
        return json_object_type(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"invalid value {value!r}: expected an optimization level (0-3) or a JSON object"
        ) from None


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


def positive_float(value: str) -> float:
    return _checked(value, float, "a number > 0", lambda x: x > 0)
