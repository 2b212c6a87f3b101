"""The machine the benchmarks ran on: in the session's header and in pytest-benchmark's saved JSON
(``machine_info["nanovllm"]``, beside pytest-benchmark's own CPU fields), from ``nanovllm.machine``."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def _machine() -> dict:
    import torch

    from nanovllm import machine

    return machine.describe(torch.get_num_threads())


def pytest_report_header(config) -> str:
    from nanovllm import machine

    return machine.header(info=_machine())


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-benchmark, when it is installed
def pytest_benchmark_update_machine_info(config, machine_info: dict) -> None:
    machine_info["nanovllm"] = _machine()
