"""Every mistake a user can make with ``python -m nanovllm.run`` ends here, as one ``error: ...`` line on stderr
and exit status 1 -- whatever found it, at whichever stage:

1. Before Hydra starts: an unknown config-group option (``hardware=nope``, or ``scheduler=fcfs,nope`` in a
   sweep), checked against the ``.yaml`` files of ``conf/<group>/`` (:func:`check_group_choices`), so the line
   names the options that exist and a close match, and no job of a sweep starts.
2. While Hydra composes: a bad override (a wrong type, a misspelt key, unparsable syntax). Hydra reports those
   in several lines of its own; :func:`one_line_errors`, around ``hydra.main``'s call, has Hydra raise them
   instead (Hydra's documented ``HYDRA_FULL_ERROR=1``, set for the call's duration only) and folds the message,
   with OmegaConf's cause naming the full key, into one line (:func:`composition_error_line`).
3. While the run checks and serves: an unknown plugin name, a plugin that does not import, an impossible
   workload or engine value, a policy that raises (:func:`user_errors`). A single run reports them from inside
   its job (:func:`exit_with_error`; raising would add Hydra's "Error executing job" line); a job of a sweep
   notes its error and lets the others run.

``HYDRA_FULL_ERROR=1``, set by the user, gives the full traceback at every stage instead (:func:`full_tracebacks`).
Only Hydra's public modules are used. This module imports nothing heavy at load time: the entry point's
interrupt handling (``nanovllm.harness.interrupt``) asks it before torch and Hydra are imported.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import sys
from pathlib import Path
from typing import Iterator, NoReturn, Sequence

EXIT_STATUS = 1  # every user error of the run, and Hydra's own status for its errors
FULL_ERROR_ENV = "HYDRA_FULL_ERROR"
# What the user asked for, kept while one_line_errors sets FULL_ERROR_ENV for Hydra; inherited by the job
# processes of parallel launchers (joblib, submitit, Ray), which must see the user's choice, not ours.
_USER_FULL_ERROR_ENV = "NANOVLLM_USER_FULL_ERROR"


def full_tracebacks() -> bool:
    """Whether the user asked for tracebacks instead of one-line errors (``HYDRA_FULL_ERROR=1``)."""
    user = os.environ.get(_USER_FULL_ERROR_ENV)
    return (user if user is not None else os.environ.get(FULL_ERROR_ENV)) == "1"


def print_error(message: str) -> None:
    """``error: <message>`` on stderr: the one line of every failure the user is to read."""
    print(f"error: {message}", file=sys.stderr, flush=True)


def exit_with_error(message: str, status: int = EXIT_STATUS) -> NoReturn:
    """Print ``error: <message>`` and end the process with ``status``."""
    print_error(message)
    sys.exit(status)


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean the user's input was wrong (reported in one line), as opposed to a bug in
    nano-vllm (reported with its traceback)."""
    # Imported here: the engine pulls in torch and transformers, which the entry point imports later.
    from nanovllm.engine.protocol import StepError
    from nanovllm.engine.scheduler import PolicyError
    from nanovllm.serving.records import RunFilesError
    from nanovllm.plugins import PluginImportError

    return (ValueError, PolicyError, PluginImportError, FileNotFoundError, StepError, RunFilesError)


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Around the entry point's Hydra call: a config-group, composition or user error that escapes it is
    printed as one ``error:`` line and ends the process with status 1 (with ``HYDRA_FULL_ERROR=1`` from the
    user: raised, with its traceback). Hydra is made to raise what it would print in several lines for the
    duration, through its own switch for that; the environment is restored afterwards."""
    from hydra.errors import CompactHydraException

    user_full = full_tracebacks()
    saved = {key: os.environ.get(key) for key in (FULL_ERROR_ENV, _USER_FULL_ERROR_ENV)}
    os.environ[_USER_FULL_ERROR_ENV] = "1" if user_full else "0"
    os.environ[FULL_ERROR_ENV] = "1"
    try:
        yield
    except CompactHydraException as exc:
        if user_full:
            raise
        print(composition_error_line(exc), file=sys.stderr, flush=True)
        sys.exit(EXIT_STATUS)
    except Exception as exc:
        if user_full or not isinstance(exc, user_errors()):
            raise
        exit_with_error(str(exc))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# -- Hydra's composition errors, in one line ---------------------------------------------------------------------

def composition_error_line(exc: BaseException) -> str:
    """``error: ...``: Hydra's message and OmegaConf's cause on one line, naming the key or option at fault.

    A listing such as ``Available options in 'scheduler':`` followed by one option a line becomes
    ``available options in 'scheduler': edf, fair, ...``; the config search path is left out."""
    from hydra.errors import OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

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


# -- config-group choices, before Hydra starts -------------------------------------------------------------------

# Hydra's command-line flags that take a value (the next argument, or after "="), and those that change where
# configs are found (then the options in conf/ are not the whole story: the check is left to Hydra).
_VALUE_FLAGS = {"-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name", "-cd",
                "--config-dir", "--experimental-rerun"}
_SEARCH_PATH_FLAGS = {"-cp", "--config-path", "-cd", "--config-dir"}
_INFO_FLAGS = {"-i", "--info"}
_INFO_TOPICS = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def check_group_choices(argv: Sequence[str], config_dir: Path) -> None:
    """Raise ``ValueError`` if an override in ``argv`` (the command line, without the program) selects a
    config-group option that has no ``.yaml`` file in ``config_dir/<group>/``; otherwise return and let Hydra
    compose. Every group shipped in ``conf/`` is covered, for single runs and for the choices of a sweep.

    Left to Hydra on purpose: its own groups (``hydra/launcher=...``), command lines that change the search
    path (``--config-dir``, ``hydra.searchpath=...``) or that Hydra cannot parse, and ``glob()``/``range()``."""
    choices = _group_choices(argv)
    groups = {p.name for p in config_dir.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    for group, names in choices:
        if group not in groups:
            continue
        if names is None:  # Hydra itself fails on group=null with a traceback
            raise ValueError(f"{group}=null: a config group cannot be set to null on the command line; "
                             f"leave it out to keep its default, or remove the default with ~{group}")
        available = sorted(p.stem for p in (config_dir / group).glob("*.yaml"))
        for name in names:
            if name not in available:
                close = difflib.get_close_matches(name, available, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"{group}={name}: no such {group} config; available: {', '.join(available)} "
                                 f"(the .yaml files in {config_dir / group}).{hint}")


def _overrides(argv: Sequence[str]) -> list[str] | None:
    """The overrides of a Hydra command line (its positional arguments), or None when it changes the search
    path."""
    overrides: list[str] = []
    args = iter(argv)
    for arg in args:
        if not arg.startswith("-"):
            overrides.append(arg)
            continue
        flag, has_value = arg.split("=", 1)[0], "=" in arg
        if flag in _SEARCH_PATH_FLAGS:
            return None
        if flag in _VALUE_FLAGS and not has_value:
            next(args, None)
        elif flag in _INFO_FLAGS and not has_value:
            following = next(args, None)
            if following is not None and following not in _INFO_TOPICS:
                overrides.append(following)
    return overrides


def _group_choices(argv: Sequence[str]) -> list[tuple[str, list[str] | None]]:
    """(key, option names) for each override that may select a group option (None for ``key=null``); []
    when the check is off."""
    overrides = _overrides(argv)
    if overrides is None:
        return []
    # Only a plain `key=value` can be a group choice; a quick filter so most command lines skip Hydra's parser.
    candidates = [o for o in overrides if "=" in o and "." not in o.split("=", 1)[0]]
    if not candidates or any(o.lstrip("+~").startswith("hydra.searchpath") for o in overrides):
        return []
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(candidates)
    except HydraException:  # a syntax error: Hydra reports it with its position
        return []
    choices = []
    for override in parsed:
        group = override.key_or_group
        if override.is_delete() or group.split("/", 1)[0] == "hydra":
            continue
        if override.is_sweep_override():
            if override.value_type not in (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP):
                continue  # glob() picks among existing options; range() and interval() are not choices
            names = list(override.sweep_string_iterator())
        else:
            value = override.value()
            if value is None:
                names = None
            else:
                names = [str(v) for v in value] if isinstance(value, list) else [override.get_value_element_as_str()]
        choices.append((group, names))
    return choices
