"""Plugin options from a config node, checked against the types their constructor declares.

A plugin's Hydra node (``scheduler``, ``allocator``, ``attention``, ``logger``) is a free-form mapping, since
each plugin takes its own options, so Hydra cannot check their types: ``scheduler.quantum=abc`` would reach
the constructor and fail deep inside it (or, worse, be accepted: ``scheduler.preempt=maybe`` is a truthy
string). :func:`check_option_types` checks each option against the constructor's type hint with pydantic in
strict mode (no coercion: ``"5"`` is not an int, ``1`` is not a bool; an int is a float), before the model
loads, and names the option as the override spells it. Value ranges stay the constructors' job.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from nanovllm.registry import Registry


def check_option_types(cls: type, options: Mapping[str, Any], where: str) -> None:
    """ValueError ``<where>.<option> must be <type>, got <value>`` for the first option whose value does not
    have the type the constructor of ``cls`` declares. Options without a hint (or a hint that does not
    resolve) are left to the constructor."""
    from pydantic import ConfigDict, TypeAdapter, ValidationError

    values = OmegaConf.to_container(options, resolve=True) if isinstance(options, DictConfig) else dict(options)
    hints = _constructor_hints(cls)
    for name, value in values.items():
        hint = hints.get(name)
        if hint is None or name == "name":
            continue
        try:
            adapter = TypeAdapter(hint, config=ConfigDict(arbitrary_types_allowed=True))
        except Exception:  # a hint pydantic cannot express: the constructor checks that option itself
            continue
        try:
            adapter.validate_python(value, strict=True)
        except ValidationError:
            raise ValueError(f"{where}.{name} must be {_describe(hint)}, got {value!r}") from None


def _constructor_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls.__init__)
    except Exception:  # an annotation naming something the module does not define at run time
        return {}


def _describe(hint: Any) -> str:
    if inspect.isclass(hint):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("collections.abc.", "")


def plugin_spec(registry: Registry, node: Any, where: str) -> dict[str, Any]:
    """``{name, **options}`` from a config node, checked now by the registry (as ``LLM(...)`` checks it)."""
    spec = registry.check(dict(node), where)
    check_option_types(registry.get(spec["name"]), node, where)
    if registry.kind in ("policy", "allocator", "logger", "router", "kv_transfer"):
        # Their constructors validate option values (an eviction or predictor name, a W&B mode); a throwaway
        # instance (a one-block allocator; a logger not yet started) reports a bad value before the model loads.
        registry.build(spec, *([1] * len(registry.engine_args)))
    return spec
