"""Config-group choices on the command line, checked before Hydra composes the config.

``python -m nanovllm.run hardware=nope`` would otherwise end in Hydra's multi-line "Could not find
'hardware/nope'" report; here it becomes one ``ValueError`` naming the group and the options that exist, which
the entry point prints as the usual ``error:`` line. Every group shipped in ``conf/`` is covered (``scheduler``,
``allocator``, ``runner``, ``hardware``, ...), for single runs and for the choices of a multirun sweep
(``scheduler=fcfs,nope``). The options are listed by Hydra's own config loader, so anything Hydra would find
there (files in ``conf/<group>/``, ConfigStore entries) counts.

Left to Hydra on purpose: its own groups (``hydra/launcher=...``, options that come from installed plugins),
command lines that change the search path (``--config-dir``, ``hydra.searchpath=...``) or that Hydra cannot
parse, and ``glob()``/``range()`` sweeps.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Sequence


def check_group_choices(argv: Sequence[str], config_dir: Path) -> None:
    """Raise ``ValueError`` if an override in ``argv`` (the command line, without the program) selects a
    config-group option that does not exist in ``config_dir``; otherwise return and let Hydra compose."""
    choices = _group_choices(argv)
    if not choices:
        return
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        groups = set(loader.list_groups(""))
        for group, names in choices:
            if group not in groups:
                continue
            if names is None:  # Hydra itself fails on group=null with a traceback
                raise ValueError(f"{group}=null: a config group cannot be set to null on the command line; "
                                 f"leave it out to keep its default, or remove the default with ~{group}")
            available = loader.get_group_options(group)
            for name in names:
                if name not in available:
                    close = difflib.get_close_matches(name, available, n=1)
                    hint = f" Did you mean {close[0]!r}?" if close else ""
                    raise ValueError(f"{group}={name}: no such {group} config; available: {', '.join(available)} "
                                     f"(the .yaml files in {config_dir / group}).{hint}")


def _group_choices(argv: Sequence[str]) -> list[tuple[str, list[str] | None]]:
    """(key, option names) for each override that may select a group option (None for ``key=null``); []
    when the check is off."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    try:
        args, _ = get_args_parser().parse_known_args(list(argv))
    except SystemExit:  # a malformed flag: Hydra's own parser reports it
        return []
    if args.config_dir or args.config_path:
        return []
    # Only a plain `key=value` can be a group choice; a quick filter so most command lines skip Hydra's parser.
    candidates = [o for o in args.overrides if "=" in o and "." not in o.split("=", 1)[0]]
    if not candidates or any(o.lstrip("+~").startswith("hydra.searchpath") for o in args.overrides):
        return []
    try:
        overrides = OverridesParser.create().parse_overrides(candidates)
    except HydraException:  # a syntax error: Hydra reports it with its position
        return []
    choices = []
    for override in overrides:
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
