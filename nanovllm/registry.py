"""One small registry class behind every plugin seam (policies, allocators, attention backends, runners,
loggers, step-time models).

A registry maps a name to a class. Built-in plugins live in packages (``policies``, ``allocators``, ...) or
modules (the runners) that are imported lazily on the first lookup, so the engine never imports a concrete
plugin itself.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
from typing import Any, Callable, Generic, Mapping, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> class for one kind of plugin (``kind`` is used in error messages, e.g. "policy").

    ``builtin_packages`` names where the built-ins register themselves: a package (each of its modules is
    imported) or a single module. ``engine_args`` names the constructor arguments the engine passes itself,
    positionally, before a config's options (an allocator gets ``num_blocks, block_size``); ``check`` needs
    them to validate the options alone.
    """

    def __init__(self, kind: str, base: type | None = None, builtin_packages: tuple[str, ...] = (),
                 engine_args: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.base = base
        self.builtin_packages = builtin_packages
        self.engine_args = engine_args
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
            for info in pkgutil.iter_modules(getattr(package, "__path__", [])):  # a module: imported above
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

    def check(self, spec: Any, where: str | None = None) -> Any:
        """Validate a plugin spec without building it: a registered name, or ``{"name": ..., **options}`` whose
        options the class's constructor accepts after the engine's own arguments. Returns the spec (a mapping
        as a plain dict); an instance passes as is. Errors name ``where`` (e.g. ``allocator``, as the Hydra
        override is spelt) and what is allowed. ``LLM(...)`` and ``python -m nanovllm.run`` both come here."""
        where = where or self.kind
        if isinstance(spec, str):
            self.get(spec)
            return spec
        if not isinstance(spec, Mapping):
            if self.base is not None and not isinstance(spec, self.base):  # e.g. a number from the command line
                raise ValueError(f"{where} must be a registered {self.kind} name, a {{name: ...}} mapping or a "
                                 f"{self.base.__name__} instance, got {spec!r}; registered {self.kind} names: "
                                 f"{', '.join(self.names())}")
            return spec
        spec = dict(spec)
        name = spec.get("name")
        if not name:
            raise ValueError(f"{where}.name is not set; registered {self.kind} names: {', '.join(self.names())}")
        if not isinstance(name, str):
            raise ValueError(f"{where}.name must be a registered name (a string), got {name!r}; registered "
                             f"{self.kind} names: {', '.join(self.names())}")
        cls = self.get(name)  # UnknownPluginError lists the names and the closest match
        options = {k: v for k, v in spec.items() if k != "name"}
        try:
            inspect.signature(cls).bind(*([None] * len(self.engine_args)), **options)
        except TypeError as exc:
            raise ValueError(f"{where}={name!r} does not take options {sorted(options)}: {exc}") from None
        return spec

    def build(self, spec: Any, *args: Any, **kwargs: Any) -> T:
        """An instance from a registered name, a ``{"name": ..., **options}`` mapping (a config node), or an
        existing instance (returned as is). ``args``/``kwargs`` are the engine's arguments (``engine_args``),
        passed to the constructor before the options; the spec is ``check``-ed first."""
        spec = self.check(spec)
        if isinstance(spec, Mapping):
            options = dict(spec)
            return self.get(options.pop("name"))(*args, **kwargs, **options)
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
