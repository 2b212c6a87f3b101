"""The layering is a checked contract: import-linter's contracts in pyproject.toml hold for the tree, and an
import against them (the engine reaching into the harness, a policy into the engine, a lower layer of the core
into a higher one) breaks them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
# The packages the contracts are about, as pyproject.toml names them: the copy of the tree holds each one.
ROOT_PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=120)


def _copy_tree(tmp_path: Path) -> Path:
    for name in ROOT_PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_every_contract(tmp_path):
    result = _lint(_copy_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def _lint_with(tmp_path, module: str, line: str) -> subprocess.CompletedProcess:
    """lint-imports over a copy of the tree in which ``module`` (a path below it) also has ``line``."""
    tree = _copy_tree(tmp_path)
    path = tree / module
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    return _lint(tree)


def test_the_copy_holds_every_root_package_of_the_contracts(tmp_path):
    assert {"nanovllm", "policies", "allocators", "routers"} <= set(ROOT_PACKAGES)
    tree = _copy_tree(tmp_path)
    assert all((tree / name / "__init__.py").is_file() for name in ROOT_PACKAGES)


def test_a_router_reaching_into_the_cluster_breaks_the_contract(tmp_path):
    result = _lint_with(tmp_path, "routers/round_robin.py", "from nanovllm.cluster.cluster import Cluster")
    assert result.returncode != 0
    assert "use only nanovllm's public interfaces BROKEN" in result.stdout


def test_an_engine_module_importing_the_harness_breaks_the_contract(tmp_path):
    result = _lint_with(tmp_path, "nanovllm/engine/scheduler.py", "from nanovllm.harness import metrics")
    assert result.returncode != 0
    assert "The engine core never imports the research harness BROKEN" in result.stdout


def test_a_policy_reaching_into_the_engine_breaks_the_contract(tmp_path):
    result = _lint_with(tmp_path, "policies/fcfs.py", "from nanovllm.engine.scheduler import Scheduler")
    assert result.returncode != 0
    assert "use only nanovllm's public interfaces BROKEN" in result.stdout


def test_the_kernels_importing_the_model_loader_break_the_layers(tmp_path):
    # The circle this contract ended: the kernel build asked the model loader for its cache directory.
    result = _lint_with(tmp_path, "nanovllm/kernels.py", "from nanovllm.models import loader")
    assert result.returncode != 0
    assert "The engine core is layered" in result.stdout and "BROKEN" in result.stdout
    assert "nanovllm.kernels -> nanovllm.models.loader" in result.stdout
