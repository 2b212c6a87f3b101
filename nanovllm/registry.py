"""One small registry class behind every plugin seam (policies, allocators, attention backends, loggers).

A registry maps a name to a class. Built-in plugins live in packages (``policies``, ``allocators``, ...) that
are imported lazily on the first lookup, so the engine never imports a concrete plugin itself.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Any, Callable, Generic, Mapping, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> class for one kind of plugin (``kind`` is used in error messages, e.g. "policy")."""

    def __init__(self, kind: str, base: type | None = None, builtin_packages: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.base = base
        self.builtin_packages = builtin_packages
        self._entries: dict[str, type[T]] = {}
        self._builtins_loaded = False

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: ``@registry.register("fcfs")``. Re-registering a name replaces it (latest wins),
        which keeps notebooks and reloaded plugin files working."""

        def decorator(cls: type[T]) -> type[T]:
            if self.base is not None and not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"{self.kind} {name!r}: {cls!r} must subclass {self.base.__name__}")
            self._entries[name] = cls
            cls.registered_name = name  # type: ignore[attr-defined]
            return cls

        return decorator

    def _load_builtins(self) -> None:
        if self._builtins_loaded:
            return
        self._builtins_loaded = True
        for package_name in self.builtin_packages:
            package = importlib.import_module(package_name)
            for info in pkgutil.iter_modules(package.__path__):
                if not info.name.startswith("_"):
                    importlib.import_module(f"{package_name}.{info.name}")

    def names(self) -> list[str]:
        """All registered names, built-ins included, sorted."""
        self._load_builtins()
        return sorted(self._entries)

    def get(self, name: str) -> type[T]:
        """The class registered as ``name``; an unknown name raises ``KeyError`` listing what exists."""
        self._load_builtins()
        if name in self._entries:
            return self._entries[name]
        close = difflib.get_close_matches(name, self._entries, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownPluginError(
            f"unknown {self.kind} {name!r}. Registered {self.kind} names: {', '.join(self.names())}.{hint}"
        )

    def build(self, spec: Any, *args: Any, **kwargs: Any) -> T:
        """An instance from a registered name, a ``{"name": ..., **options}`` mapping (a config node), or an
        existing instance (returned as is). ``args``/``kwargs`` go to the constructor before the options."""
        if isinstance(spec, Mapping):
            options = dict(spec)
            name = options.pop("name", None)
            if not name:
                raise ValueError(f"{self.kind} config needs a 'name'; registered: {', '.join(self.names())}")
            return self.get(name)(*args, **kwargs, **options)
        if isinstance(spec, str):
            return self.get(spec)(*args, **kwargs)
        if self.base is not None and not isinstance(spec, self.base):
            raise TypeError(f"{self.kind} must be a registered name, a {{'name': ...}} mapping or a "
                            f"{self.base.__name__} instance, got {spec!r}")
        return spec

    def __contains__(self, name: str) -> bool:
        self._load_builtins()
        return name in self._entries


class UnknownPluginError(KeyError, ValueError):
    """Raised for a name no plugin is registered under. A KeyError for lookups, a ValueError for config checks."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])
