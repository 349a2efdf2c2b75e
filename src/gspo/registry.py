"""Name -> object registries: the one way gspo makes a thing selectable by name in a config.

A `Registry` holds what one kind of name selects (tasks, reward types, objectives, engines...):
``add`` or the ``@register(name)`` decorator put an object in, a name given twice is refused,
``get`` answers an unknown name with one line that lists the valid ones, ``names()`` lists them
sorted (what configs and error messages show) and iterating gives them in registration order.

The bottom layer, with ``gspo.errors``: plain Python, it imports nothing of gspo and no third
party, so every layer (``core``, ``tasks``...) can hold its registry here.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["Registry"]


class Registry(Generic[T]):
    """The objects of one ``kind`` ("task", "reward type"...) by name.

    Messages: ``unknown task 'x'; valid tasks: a, b`` (``valid`` sets the "valid tasks" label,
    default "valid") raised as ``error`` (default ValueError); ``task 'x' is already registered``
    (ValueError) for a name added twice.
    """

    def __init__(self, kind: str, *, valid: str = "valid", error: type[Exception] = ValueError):
        self.kind, self.valid, self.error = kind, valid, error
        self._items: dict[str, T] = {}

    def add(self, name: str, obj: T) -> T:
        """Register ``obj`` under ``name`` and return it; ValueError if the name is taken."""
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj
        return obj

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@registry.register("name")`` adds the function or class, unchanged."""
        return lambda obj: self.add(name, obj)

    def get(self, name: str) -> T:
        """The object of ``name``; ``error`` with the valid names if there is none."""
        if name not in self._items:
            raise self.error(self.unknown(name))
        return self._items[name]

    def unknown(self, name: object) -> str:
        """The one-line message for a name that is not registered."""
        return f"unknown {self.kind} {name!r}; {self.valid}: {', '.join(self.names())}"

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._items)

    def copy(self) -> Registry[T]:
        """A registry of the same kind holding the same entries (tests register into a copy)."""
        other: Registry[T] = Registry(self.kind, valid=self.valid, error=self.error)
        other._items = dict(self._items)
        return other

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        """The names in the order they were registered."""
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._items)})"
