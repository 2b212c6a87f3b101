"""Test hook of ``tests/harness/test_interrupt.py``: park a ``python -m nanovllm.run`` subprocess in one phase of its
start-up so that a signal lands there for sure, with no sleep in the test.

Python imports ``sitecustomize`` at start-up from ``sys.path``; the test puts this directory first on
``PYTHONPATH`` and names the place in ``NANOVLLM_TEST_HOLD``:

* ``<module>``: when ``<module>`` is first imported (``torch``: the imports; a module Hydra imports while it
  composes the config: Hydra's composition);
* ``<module>:<function>``: when ``<module>.<function>`` is called (``nanovllm.engine.model_runner:load_model``:
  the model load; ``nanovllm.engine.warmup:_requests``: inside the engine's warm-up).

There the process writes ``NANOVLLM_TEST_HOLD_MARKER`` (a file path) and sleeps (for at most a minute, then
goes on), so the test waits for the file and sends its signal. Nothing happens without ``NANOVLLM_TEST_HOLD``.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import time
from pathlib import Path

HOLD = os.environ.get("NANOVLLM_TEST_HOLD", "")
MARKER = os.environ.get("NANOVLLM_TEST_HOLD_MARKER", "")


def _park() -> None:
    Path(MARKER).write_text(f"{os.getpid()}\n")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)


class _Hold(importlib.abc.MetaPathFinder):
    def __init__(self, module: str, function: str | None) -> None:
        self.module, self.function = module, function

    def find_spec(self, name, path, target=None):
        if name != self.module:
            return None
        sys.meta_path.remove(self)  # once, and not in the way of the real lookup below
        if self.function is None:
            _park()
            return None  # the import goes on as usual
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        function = self.function

        def exec_and_wrap(module):
            exec_module(module)
            real = getattr(module, function)

            @functools.wraps(real)
            def held(*args, **kwargs):
                _park()
                return real(*args, **kwargs)

            setattr(module, function, held)

        spec.loader.exec_module = exec_and_wrap
        return spec


if HOLD and MARKER:
    module_name, _, function_name = HOLD.partition(":")
    sys.meta_path.insert(0, _Hold(module_name, function_name or None))
