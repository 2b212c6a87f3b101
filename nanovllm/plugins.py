"""User plugin files and modules, loaded so their ``@register_policy`` / ``@register_allocator`` /
``@register_attention`` (or any registry's ``register``) run before a name is looked up.

The same loader serves every front door: ``python -m nanovllm.run plugins=[my_policies.py]``,
``LLM(..., plugins=["my_policies.py"])`` and ``nanovllm.load_plugins([...])`` in your own code::

    from nanovllm import LLM, load_plugins
    load_plugins(["experiments/my_policy.py"])        # a .py file (or a path with a slash)
    load_plugins(["my_package.policies"])             # a module, looked up from the working directory too
    llm = LLM(scheduler="shortest_prompt_first")
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Iterable


class PluginImportError(ImportError):
    """A module or file named in ``plugins`` could not be imported; the message names it and says why."""


def load_plugins(plugins: Iterable[str]) -> None:
    """Import each plugin (a module name, or the path of a ``.py`` file) so its ``@register_*`` runs. A file is
    imported once per process however often it is named (every job of a multirun names it again)."""
    for entry in plugins:
        try:
            if entry.endswith(".py") or "/" in entry or os.sep in entry:
                _import_file(Path(entry).expanduser())
            else:
                _import_module(entry)
        except PluginImportError:
            raise
        except Exception as exc:
            raise PluginImportError(f"plugins: {entry!r} failed to import: {type(exc).__name__}: {exc}") from exc


_imported_files: set[Path] = set()


def _import_file(path: Path) -> None:
    if not path.is_file():
        raise PluginImportError(f"plugins: file {str(path)!r} does not exist (cwd: {os.getcwd()})")
    if path.resolve() in _imported_files:
        return
    # Its own name when free (so reprs and pickles read naturally), else one that cannot clash.
    name = path.stem if path.stem.isidentifier() and path.stem not in sys.modules else f"_nanovllm_plugin_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    _imported_files.add(path.resolve())


def _import_module(name: str) -> None:
    # The console script does not put the working directory on sys.path the way `python -m` does.
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        importlib.import_module(name)
    finally:
        if added:
            sys.path.remove(cwd)
