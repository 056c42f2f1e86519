"""Name registries for pluggable components (losses, advantages, rollout engines, tasks).

A registry maps a name to a callable. Registering a name twice is an error, and looking up
an unknown name raises an error that lists the valid names, so a typo in a config fails
loudly and says how to fix it.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T", bound=Callable)


class Registry(Generic[T]):
    """A named table of callables of one kind (e.g. "loss")."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@LOSSES.register("grpo")``."""

        def decorator(fn: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise KeyError(f"{self.kind} '{name}' unknown; choose from: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries
