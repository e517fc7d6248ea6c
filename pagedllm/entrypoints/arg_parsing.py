"""How ``pagedllm serve`` reads its command line, as vLLM's ``vllm serve`` does.

- ``--config FILE.yaml``: a YAML mapping of flag names (``tensor-parallel-size`` or
  ``tensor_parallel_size``, without dashes in front) to values. The command line wins over
  the file, the file over the defaults (vLLM's order). ``true`` sets a switch, ``false``
  turns a ``--x / --no-x`` switch off; a list fills a flag that takes several values; a
  mapping is a JSON-object flag's object (``structured-outputs-config: {backend: guidance}``),
  and a dotted key one key of it (``structured-outputs-config.backend: guidance``), as on the
  command line.
- ``--max_model_len`` means ``--max-model-len`` (vLLM accepts both spellings).
- ``--structured-outputs-config.backend guidance`` sets one key of a JSON-object flag (vLLM's
  dotted form; the value is read as JSON when it is JSON, else kept as a string), over the
  flag's own JSON object; ``--x.a.b 1`` sets ``{"a": {"b": 1}}``, merged with the object's
  ``a``. vLLM's earlier ``--guided-decoding-backend X`` and
  ``--guided-decoding-disable-fallback`` / ``-disable-any-whitespace`` /
  ``-disable-additional-properties`` switches set those keys of ``--structured-outputs-config``.
- An unknown flag gets a "did you mean" suggestion (``difflib``) after the parser's usage
  line, exit code 2.

``make_flexible(parser)`` installs this on one parser (``pagedllm serve``'s); the module
imports no more than the standard library (PyYAML only when ``--config`` is given).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import types
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence

CONFIG_FLAG = "--config"
#: vLLM's earlier flags -> (the JSON-object flag, its key they set, whether they are switches).
KEY_FLAGS = {
    "--guided-decoding-backend": ("--structured-outputs-config", "backend", False),
    "--guided-decoding-disable-fallback": ("--structured-outputs-config", "disable_fallback", True),
    "--guided-decoding-disable-any-whitespace": ("--structured-outputs-config", "disable_any_whitespace", True),
    "--guided-decoding-disable-additional-properties": (
        "--structured-outputs-config", "disable_additional_properties", True),
}


def make_flexible(parser: argparse.ArgumentParser) -> None:
    """Make ``parser.parse_known_args`` read ``--config``, accept underscores in flag names
    and refuse unknown flags with a suggestion (see the module docstring). Argparse's
    sub-command action calls ``parse_known_args``, so this holds for ``pagedllm serve``."""
    parser.parse_known_args = types.MethodType(_parse_known_args, parser)  # type: ignore[method-assign]


def _parse_known_args(
    parser: argparse.ArgumentParser, args: Optional[Sequence[str]] = None, namespace: Optional[argparse.Namespace] = None
) -> tuple[argparse.Namespace, list[str]]:
    arg_list = [_dashed(arg) for arg in (sys.argv[1:] if args is None else args)]
    namespace = namespace if namespace is not None else argparse.Namespace()
    config_path = _config_path(arg_list)
    if config_path is not None:
        for dest, value in config_file_values(parser, config_path).items():
            if not hasattr(namespace, dest):
                setattr(namespace, dest, value)
    arg_list, keys = _key_assignments(parser, arg_list)
    namespace, extras = argparse.ArgumentParser.parse_known_args(parser, arg_list, namespace)
    if extras:
        refuse_unknown(parser, extras)
    apply_keys(namespace, keys)
    return namespace, extras


def apply_keys(namespace: argparse.Namespace, keys: list[tuple[str, str, Any]]) -> None:
    """Set each ``(dest, "a.b", value)`` of ``_key_assignments`` in ``namespace``: the JSON
    object at ``dest`` (None: a new one) gets ``{"a": {"b": value}}``, merged into its mappings
    (a later key wins over an earlier one). The objects are copied, not changed in place."""
    for dest, key, value in keys:
        updated = dict(getattr(namespace, dest, None) or {})
        target = updated
        *path, last = key.split(".")
        for part in path:
            inner = target.get(part)
            target[part] = dict(inner) if isinstance(inner, dict) else {}
            target = target[part]
        target[last] = value
        setattr(namespace, dest, updated)


def _is_json_object_flag(action: Optional[argparse.Action]) -> bool:
    """Whether ``action``'s flag takes a JSON object (its type turns ``"{}"`` into a dict)."""
    if action is None or not callable(action.type):
        return False
    try:
        return isinstance(action.type("{}"), dict)
    except (argparse.ArgumentTypeError, TypeError, ValueError):
        return False


def _key_assignments(
    parser: argparse.ArgumentParser, args: list[str]
) -> tuple[list[str], list[tuple[str, str, Any]]]:
    """``args`` without the dotted keys and ``KEY_FLAGS`` (module docstring), and what they
    set: ``(dest of the JSON-object flag, key, value)``, in command-line order. A dotted
    name whose flag takes no JSON object stays in ``args`` (argparse calls it unknown)."""
    rest: list[str] = []
    keys: list[tuple[str, str, Any]] = []
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        name, sep, value = arg.partition("=")
        option, key, switch = KEY_FLAGS.get(name, (name.partition(".")[0], name.partition(".")[2], False))
        action = parser._option_string_actions.get(option) if arg.startswith("--") and key else None
        if not _is_json_object_flag(action):
            rest.append(arg)
            continue
        if switch:
            keys.append((action.dest, key, True))  # type: ignore[union-attr]
            continue
        if not sep:
            if index == len(args) or args[index].startswith("--"):
                parser.error(f"argument {name}: expected one argument")
            value = args[index]
            index += 1
        try:
            parsed: Any = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        keys.append((action.dest, key.replace("-", "_"), parsed))  # type: ignore[union-attr]
    return rest, keys


def _dashed(arg: str) -> str:
    """``--max_model_len=8k`` -> ``--max-model-len=8k``; other arguments unchanged."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


def _config_path(args: list[str]) -> Optional[str]:
    for index, arg in enumerate(args):
        if arg == CONFIG_FLAG and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(CONFIG_FLAG + "="):
            return arg.split("=", 1)[1]
    return None


def suggestion(parser: argparse.ArgumentParser, flag: str) -> Optional[str]:
    """The parser's long flag closest to ``flag`` (``difflib``), or None when none is close."""
    options = [option for option in parser._option_string_actions if option.startswith("--")]
    close = difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
    return close[0] if close else None


def refuse_unknown(parser: argparse.ArgumentParser, extras: Sequence[str], source: str = "") -> NoReturn:
    """Print the usage line and ``unrecognized arguments: --x (did you mean --y?)``; exit 2."""
    described = []
    for arg in extras:
        hint = suggestion(parser, arg.split("=", 1)[0]) if arg.startswith("-") else None
        described.append(f"{arg} (did you mean {hint}?)" if hint else arg)
    parser.print_usage(sys.stderr)
    parser.exit(2, f"{parser.prog}: error: unrecognized arguments{source}: {' '.join(described)}\n")


def config_file_values(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """``{dest: value}`` of the flags set in the YAML file ``path``, parsed (types, choices)
    as the same flags on the command line would be.

    Exits (``parser.error``, code 2) when the file cannot be read, is not a YAML mapping,
    or names an unknown flag or a bad value.
    """
    try:
        import yaml
    except ImportError:
        parser.error(f"{CONFIG_FLAG} needs PyYAML: pip install pyyaml")
    try:
        content = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"{CONFIG_FLAG} {path}: cannot read it: {' '.join(str(exc).split())}")
    if not isinstance(content, dict):
        parser.error(f"{CONFIG_FLAG} {path}: expected a mapping of flag names to values, got {type(content).__name__}")
    file_args, actions = _config_file_args(parser, path, content)
    file_args, keys = _key_assignments(parser, file_args)
    namespace, extras = argparse.ArgumentParser.parse_known_args(parser, file_args, argparse.Namespace())
    if extras:
        refuse_unknown(parser, extras, f" in {path}")
    apply_keys(namespace, keys)
    return {action.dest: getattr(namespace, action.dest) for action in actions}


def _config_file_args(
    parser: argparse.ArgumentParser, path: str, content: dict
) -> tuple[list[str], list[argparse.Action]]:
    """The command-line form of a config file's mapping, and the action of each flag it sets
    (a dotted key ``flag.key``, of a JSON-object flag, as ``--flag.key VALUE``).

    Exits (``refuse_unknown``) on an unknown flag, or a dotted key of a flag that takes no JSON object.
    """
    file_args: list[str] = []
    actions = []
    for key, value in content.items():
        name, dot, subkey = str(key).lstrip("-").partition(".")
        option = "--" + name.replace("_", "-")
        action = parser._option_string_actions.get(option)
        if action is None or option == CONFIG_FLAG or (dot and not _is_json_object_flag(action)):
            refuse_unknown(parser, [option + dot + subkey], f" in {path}")
        actions.append(action)
        if dot:
            file_args += [f"{option}.{subkey}", value if isinstance(value, str) else json.dumps(value)]
        else:
            file_args += flag_as_args(option, action, value)
    return file_args, actions


def inline_config_file(parser: argparse.ArgumentParser, args: Sequence[str]) -> list[str]:
    """``args`` (parsed by ``parser`` without error) with ``--config FILE`` replaced by the flags
    the file sets, put first: the command line still wins over the file, and the result no
    longer needs the file. ``args`` unchanged without ``--config``."""
    arg_list = [_dashed(arg) for arg in args]
    path = _config_path(arg_list)
    if path is None:
        return arg_list
    import yaml

    file_args, _ = _config_file_args(parser, path, yaml.safe_load(Path(path).read_text()))
    return file_args + drop_flag(parser, arg_list, CONFIG_FLAG)


def _action_of(parser: argparse.ArgumentParser, arg: str) -> Optional[argparse.Action]:
    """The action a ``--flag`` / ``--flag=value`` argument names (an unambiguous prefix too,
    as argparse allows), or None."""
    if not arg.startswith("--"):
        return None
    name = _dashed(arg).partition("=")[0]
    options = parser._option_string_actions
    if name in options:
        return options[name]
    found = {id(action): action for option, action in options.items() if option.startswith(name)}
    return next(iter(found.values())) if len(found) == 1 else None


def _is_value(arg: str) -> bool:
    """Whether argparse takes ``arg`` as a value, not a flag."""
    if not arg.startswith("-") or arg == "-":
        return True
    try:
        float(arg)
    except ValueError:
        return False
    return True


def drop_flag(parser: argparse.ArgumentParser, args: Sequence[str], option: str) -> list[str]:
    """``args`` (parsed by ``parser`` without error) without every use of the flag ``option``
    (``--api-key``) and its values, in each spelling argparse accepts: ``--flag value``,
    ``--flag=value``, several values for a flag that takes them, ``--flag_name``, a prefix."""
    target = parser._option_string_actions[option]
    kept: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if _action_of(parser, arg) is not target:
            kept.append(arg)
            continue
        if "=" in arg:
            continue
        nargs = target.nargs
        most = {None: 1, "?": 1, "+": len(args), "*": len(args)}.get(nargs, nargs)  # type: ignore[arg-type]
        taken = 0
        while index < len(args) and taken < most and _is_value(args[index]):
            index += 1
            taken += 1
    return kept


def flag_as_args(option: str, action: argparse.Action, value: Any) -> list[str]:
    """The command-line form of ``option: value`` (from a config file): none for None, the
    switch (or ``--no-`` switch) for a bool, a JSON string for a dict or list."""
    if value is None:
        return []
    if isinstance(value, bool) and action.nargs == 0:
        if value:
            return [option]
        return ["--no-" + option[2:]] if isinstance(action, argparse.BooleanOptionalAction) else []
    if isinstance(value, list) and action.nargs in ("+", "*"):
        return [option, *(str(item) for item in value)]
    if isinstance(value, (list, dict)):
        return [option, json.dumps(value)]
    return [option, str(value)]
