"""Name registries for pluggable components, and the four kinds a run picks by name: policy losses, advantage
estimators, rollout engines and tasks (below, each with its home: the package whose modules register its entries).

A registry maps a name to a callable. Registering a name twice is an error, and looking up
an unknown name raises an error that lists the valid names, so a typo in a config fails
loudly and says how to fix it. A registry with a home imports it on the first look-up, so any layer can look a name
up (the step's config reads what its advantage estimator declares) without importing the package above it.

A name of the form ``package.module:attribute`` is imported on first use (as ``data.reward`` is), so a component
in your own package needs no edit of the library, and a process that only receives the name (a rollout worker)
finds it too.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T", bound=Callable)


class Registry(Generic[T]):
    """A named table of callables of one kind (e.g. "loss")."""

    def __init__(self, kind: str, home: str | None = None):
        self.kind, self.home = kind, home
        self._entries: dict[str, T] = {}

    def register(self, name: str, params: type | None = None) -> Callable[[T], T]:
        """Decorator: ``@LOSSES.register("grpo")``. ``params``: the dataclass of the entry's own hyperparameters
        (``algo.params`` for a loss), kept on the function as ``fn.params``, the way an imported entry declares them."""

        def decorator(fn: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            if params is not None:
                fn.params = params
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> T:
        self._load_home()
        if name not in self._entries and ":" in name:
            self._entries[name] = self._imported(name)
        if name not in self._entries:
            raise KeyError(f"{self.kind} '{name}' unknown; choose from: {', '.join(self.names())} "
                           "(or package.module:attribute)")
        return self._entries[name]

    def names(self) -> list[str]:
        """The registered names (imported ``module:attribute`` ones aside)."""
        self._load_home()
        return sorted(n for n in self._entries if ":" not in n)

    def __contains__(self, name: str) -> bool:
        try:
            self.get(name)
        except KeyError:
            return False
        return True

    def _load_home(self) -> None:
        if self.home is not None:
            import importlib

            home, self.home = self.home, None  # once: its modules register into this registry as they load
            importlib.import_module(home)

    def _imported(self, name: str) -> T:
        import importlib

        module_name, _, attribute = name.partition(":")
        try:
            found = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as err:
            raise KeyError(f"{self.kind} '{name}': cannot import it ({type(err).__name__}: {err})") from None
        if not callable(found):
            raise KeyError(f"{self.kind} '{name}' is not callable")
        return found


def import_folder(package: str, path) -> None:
    """Import every module of a package's folder (``__name__``, ``__path__``), so that each registers its entries: a
    new loss, estimator, engine or task is its module, with no import to add anywhere."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(path):
        importlib.import_module(f"{package}.{module.name}")


LOSSES: Registry = Registry("policy loss", home="bicc.method.losses")
ADVANTAGES: Registry = Registry("advantage estimator", home="bicc.method.advantages")
ENGINES: Registry = Registry("rollout engine", home="bicc.rollout")
TASKS: Registry = Registry("task", home="bicc.data")
