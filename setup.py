"""The one thing pyproject.toml cannot say: which packages ship, found rather than listed. The code packages
(nanovllm and its subpackages, policies, allocators, routers, proposers, spec_policies), and conf/ as ``nanovllm.conf`` with every Hydra config
group under it as a subpackage, so a new group ships in the wheel without touching packaging
(tests/harness/test_run.py::test_runs_from_an_installed_wheel checks that every group ships). The rest is in
pyproject.toml."""

from setuptools import find_namespace_packages, setup

NOT_PACKAGES = ["__pycache__", "*.__pycache__"]
# Namespace discovery: nanovllm/data holds only data files, no __init__.py.
code = find_namespace_packages(include=["nanovllm", "nanovllm.*", "policies", "allocators", "routers", "proposers", "spec_policies"], exclude=NOT_PACKAGES)
conf_groups = find_namespace_packages(where="conf", exclude=NOT_PACKAGES)
setup(
    packages=code + ["nanovllm.conf"] + [f"nanovllm.conf.{group}" for group in conf_groups],
    package_dir={"nanovllm.conf": "conf"},
)
