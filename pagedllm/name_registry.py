"""``NameRegistry``: classes by name, filled by a ``register_module(name)`` decorator on each
class (the shape of vLLM's parser managers: ``--tool-call-parser``, ``--reasoning-parser``).
Plain Python; each subclass has its own entries."""

from __future__ import annotations

from typing import Any, Callable, ClassVar, TypeVar

C = TypeVar("C", bound=type)


class NameRegistry:
    """Name -> registered class; ``what`` names the kind in the unknown-name error."""

    what: ClassVar[str] = "name"
    entries: ClassVar[dict[str, type]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.entries = {}

    @classmethod
    def register_module(cls, name: str) -> Callable[[C], C]:
        """A class decorator registering the class as ``name``."""

        def register(registered: C) -> C:
            cls.entries[name] = registered
            return registered

        return register

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls.entries)

    @classmethod
    def lookup(cls, name: str) -> type:
        """The class registered as ``name``.

        Raises:
            KeyError: no such name; the message lists the known ones (vLLM's wording).
        """
        if name not in cls.entries:
            raise KeyError(f"invalid {cls.what}: {name} (chose from {{ {','.join(cls.names())} }})")
        return cls.entries[name]
