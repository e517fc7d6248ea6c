"""Command-line flags declared on the fields of configuration dataclasses.

A field made by ``flag_field`` carries its flag (``Flag``: help, type, choices, aliases,
metavar, action, group) in its metadata; one made by ``not_a_flag`` says why it has none.
``add_flags`` adds a dataclass's flags to a parser (vLLM derives its CLI from its config
dataclasses the same way), so every command that takes them declares each one once:
``--name-with-dashes`` for the field ``name_with_dashes``, its value stored under the
field's name. Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

#: Metadata keys of a field: its ``Flag``, or why it has none.
FLAG = "flag"
NOT_A_FLAG = "not_a_flag"


@dataclass(frozen=True)
class Flag:
    """One field's flag: ``argparse.add_argument``'s keywords, and the parser ``group``
    it is listed under in ``--help`` (a key of ``add_flags``' ``groups``).

    ``metavar`` may be a callable returning it, evaluated when the flag is added (for a
    list known only at run time, e.g. registered parsers). ``extra``: further keywords of
    a custom ``action``.
    """

    help: str
    type: Optional[Callable[[str], Any]] = None
    choices: Optional[Sequence[Any]] = None
    aliases: tuple[str, ...] = ()
    metavar: Union[str, Callable[[], str], None] = None
    action: Any = None
    nargs: Union[int, str, None] = None
    group: str = "engine"
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def flag_field(default: Any = None, *, help: str, **flag: Any) -> Any:
    """A dataclass field whose default is ``default`` (a list is copied per instance) and
    whose flag is ``Flag(help, **flag)``."""
    metadata = {FLAG: Flag(help, **flag)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def not_a_flag(default: Any = None, *, why: str) -> Any:
    """A dataclass field with no flag; ``why`` says where its value comes from instead."""
    return dataclasses.field(default=default, metadata={NOT_A_FLAG: why})


def option_string(name: str) -> str:
    """The flag of the field ``name``: ``max_model_len`` -> ``--max-model-len``."""
    return "--" + name.replace("_", "-")


def flag_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of the dataclass ``cls`` that are flags, in declaration order.

    Raises:
        TypeError: a field declared neither by ``flag_field`` nor by ``not_a_flag``.
    """
    result = []
    for f in dataclasses.fields(cls):
        if FLAG in f.metadata:
            result.append(f)
        elif NOT_A_FLAG not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is declared neither as a flag nor as not a flag.")
    return result


def field_default(f: dataclasses.Field) -> Any:
    """A field's default value (a fresh one from its factory); None without a default."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def add_flags(cls: type, groups: Any, *, unset: bool = False) -> None:
    """Add the flags of ``cls``'s fields to ``groups[flag.group]`` (parsers or argument
    groups), or all of them to ``groups`` itself when it is one parser or group.

    Each default is the field's, or None with ``unset`` (then a flag not given is None,
    and a caller passes on only the flags that were given).

    Raises:
        KeyError: a flag's group missing from ``groups``.
    """
    for f in flag_fields(cls):
        spec: Flag = f.metadata[FLAG]
        kwargs: dict[str, Any] = {"dest": f.name, "help": spec.help, "default": None if unset else field_default(f)}
        for key in ("type", "choices", "action", "nargs"):
            if getattr(spec, key) is not None:
                kwargs[key] = getattr(spec, key)
        if spec.metavar is not None:
            kwargs["metavar"] = spec.metavar() if callable(spec.metavar) else spec.metavar
        target = groups[spec.group] if isinstance(groups, Mapping) else groups
        target.add_argument(option_string(f.name), *spec.aliases, **kwargs, **spec.extra)


def flag_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """``{field: value}`` of every flag of ``cls`` in the parsed ``args``.

    Raises:
        ValueError: naming the flags ``args`` lacks (its parser did not get ``cls``'s flags).
    """
    names = [f.name for f in flag_fields(cls)]
    missing = [option_string(name) for name in names if not hasattr(args, name)]
    if missing:
        raise ValueError(f"the parsed arguments lack flags of {cls.__name__}: {', '.join(missing)}.")
    return {name: getattr(args, name) for name in names}


def given_flag_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """``{field: value}`` of the flags of ``cls`` that ``args`` holds and are not None
    (with ``add_flags(..., unset=True)``: the flags that were given)."""
    values = {f.name: getattr(args, f.name, None) for f in flag_fields(cls)}
    return {name: value for name, value in values.items() if value is not None}
