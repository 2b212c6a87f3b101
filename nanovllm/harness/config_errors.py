"""Mistakes Hydra finds while composing the config, as the one ``error: ...`` line every other mistake gives.

Hydra reports a bad override (a wrong type, a misspelt key, an unknown group option, unparsable syntax) in
several lines of its own, plus a hint about ``HYDRA_FULL_ERROR``. ``python -m nanovllm.run`` promises one
``error:`` line on stderr and exit status 1 for anything the user got wrong, whatever found it, so
:func:`composition_error_line` folds Hydra's message (and OmegaConf's cause, which names the full key) into one
line, and :func:`one_line_composition_errors` makes Hydra print that line instead of its own report.
``HYDRA_FULL_ERROR=1`` still gives the full traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Iterator

from hydra.errors import CompactHydraException, OverrideParseException
from omegaconf.errors import OmegaConfBaseException

EXIT_STATUS = 1  # the same status as every other user error of the run (run.py) and as Hydra's own


def composition_error_line(exc: BaseException) -> str:
    """``error: ...``: Hydra's message and OmegaConf's cause on one line, naming the key or option at fault.

    A listing such as ``Available options in 'scheduler':`` followed by one option a line becomes
    ``available options in 'scheduler': edf, fair, ...``; the config search path is left out."""
    parts = _fold(str(exc))
    if isinstance(exc, OverrideParseException):
        parts.insert(0, f"cannot parse override {exc.override!r}")
    cause = exc.__cause__
    if isinstance(cause, OmegaConfBaseException):
        # OmegaConf's own message ends with its context (full_key, reference_type, object_type): the key is
        # kept once, as the override spells it, the class names are dropped.
        parts += [part for part in _fold(str(cause)) if not part.startswith(_OMEGACONF_CONTEXT)]
        full_key = getattr(cause, "full_key", None)
        if full_key and not any(full_key in part for part in parts):
            parts.append(f"key: {full_key}")
    return "error: " + "; ".join(part.rstrip(".") for part in parts)


_OMEGACONF_CONTEXT = ("full_key:", "reference_type=", "object_type=")


def _fold(text: str) -> list[str]:
    """Hydra's lines as parts of one line: an indented line after a ``...:`` heading is an item of its list."""
    parts: list[str] = []
    listing = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("Config search path"):
            break
        if raw[0] in " \t" and parts and (listing or parts[-1].endswith(":")):
            parts[-1] += (", " if listing else " ") + line
            listing = True
            continue
        listing = False
        parts.append(line)
    return parts


@contextlib.contextmanager
def one_line_composition_errors() -> Iterator[None]:
    """While inside, Hydra reports a composition error as :func:`composition_error_line` and exit status 1.

    Hydra has no hook for how it reports these: every stage of ``hydra.main`` runs through
    ``hydra._internal.utils.run_and_report``, so that function is wrapped for the duration (and restored)."""
    from hydra._internal import utils as hydra_utils

    original = hydra_utils.run_and_report

    def run_and_report(func: Callable[[], Any]) -> Any:
        def attempt() -> Any:
            try:
                return func()
            except CompactHydraException as exc:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                print(composition_error_line(exc), file=sys.stderr)
                sys.exit(EXIT_STATUS)

        return original(attempt)

    hydra_utils.run_and_report = run_and_report
    try:
        yield
    finally:
        hydra_utils.run_and_report = original
