"""Every plugin seam is declared one way: a ``Registry`` named in upper-case plural, a ``register_<seam>``
decorator and a base class in the seam's own module, all three exported from ``nanovllm``; its built-ins live in
the modules its registry names; ``nanovllm.seams`` lists them all; and the README's seam table agrees with the
registries, both ways."""

from __future__ import annotations

import ast
import re
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import nanovllm
from nanovllm.registry import Registry
from nanovllm.seams import SEAMS, main

ROOT = Path(__file__).resolve().parents[2]
# Where shipped plugins live: the root packages of the layering contracts (pyproject.toml), so it cannot drift.
BUILTIN_ROOTS = tuple(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"])


def _registries_in_the_source() -> set[str]:
    """Names of the module-level ``X = Registry(...)`` assignments anywhere in ``nanovllm/``."""
    names = set()
    for path in (ROOT / "nanovllm").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "Registry":
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return names


def test_the_seam_table_holds_every_registry_of_the_package():
    assert {seam.name for seam in SEAMS} == _registries_in_the_source()
    assert len({id(seam.registry) for seam in SEAMS}) == len(SEAMS)


@pytest.mark.parametrize("seam", SEAMS, ids=lambda seam: seam.name)
def test_a_seam_is_a_registry_a_decorator_and_a_base_class_in_one_module_all_exported(seam):
    module = sys.modules[seam.register.__module__]
    assert re.fullmatch(r"[A-Z][A-Z_]*S", seam.name)
    assert getattr(module, seam.name) is seam.registry and isinstance(seam.registry, Registry)
    assert seam.register.__name__.startswith("register_")
    assert seam.base.__module__ == module.__name__
    for public in (seam.name, seam.register.__name__, seam.base.__name__):
        assert public in nanovllm.__all__
    assert getattr(nanovllm, seam.name) is seam.registry
    assert getattr(nanovllm, seam.register.__name__) is seam.register
    assert getattr(nanovllm, seam.base.__name__) is seam.base


@pytest.mark.parametrize("seam", SEAMS, ids=lambda seam: seam.name)
def test_the_decorator_registers_into_its_seam_and_checks_the_base(seam):
    name = f"_seam_test_{seam.name.lower()}"
    plugin = type("SeamTestPlugin", (seam.base,), {})
    try:
        assert seam.register(name)(plugin) is plugin
        assert seam.registry.get(name) is plugin and name in seam.registry.names()
    finally:
        seam.registry._entries.pop(name, None)
    with pytest.raises(TypeError, match=f"must subclass {seam.base.__name__}"):
        seam.register(name)(type("NotAPlugin", (), {}))


@pytest.mark.parametrize("seam", SEAMS, ids=lambda seam: seam.name)
def test_built_ins_live_where_their_registry_says(seam):
    assert seam.registry.builtin_packages
    builtins = [seam.registry.get(name) for name in seam.registry.names()]
    shipped = [cls for cls in builtins if cls.__module__.split(".")[0] in BUILTIN_ROOTS]
    assert shipped, f"{seam.name} has no built-in"
    for cls in shipped:
        assert any(cls.__module__ == package or cls.__module__.startswith(package + ".")
                   for package in seam.registry.builtin_packages), (cls, seam.registry.builtin_packages)


def test_the_listing_names_every_seam_and_a_plugin_file_s_names(tmp_path, capsys):
    plugin = tmp_path / "seam_listing_plugin.py"
    plugin.write_text(textwrap.dedent('''
        from nanovllm import Policy, register_policy

        @register_policy("listed_by_the_seams_command")
        class Listed(Policy):
            """Registered only to be listed."""
    '''))
    try:
        main([str(plugin)])
    finally:  # other tests enumerate the built-in policies
        nanovllm.POLICIES._entries.pop("listed_by_the_seams_command", None)
    listing = capsys.readouterr().out
    for seam in SEAMS:
        assert f"{seam.decides}: {seam.name}, @{seam.register.__name__}" in listing
        assert ", ".join(seam.registry.builtin_packages) in listing
    policies = next(line for line in listing.splitlines() if "registered:" in line and "fcfs" in line)
    assert "listed_by_the_seams_command" in policies


def _readme_seam_table() -> dict[str, set[str]]:
    """Registry name -> the built-in names the README's seam table lists for it (backticked, outside brackets)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("| seam | registry | built-ins | chosen by |")
    table = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        builtins = cells[2]
        while re.search(r"\([^()]*\)", builtins):  # asides, innermost first
            builtins = re.sub(r"\([^()]*\)", "", builtins)
        table[cells[1].strip("`")] = set(re.findall(r"`(\w+)`", builtins))
    return table


def test_the_readme_seam_table_matches_the_registries_both_ways():
    table = _readme_seam_table()
    assert set(table) == {seam.name for seam in SEAMS}
    for seam in SEAMS:
        registered = {name for name in seam.registry.names()
                      if seam.registry.get(name).__module__.split(".")[0] in BUILTIN_ROOTS}
        assert table[seam.name] == registered, seam.name
