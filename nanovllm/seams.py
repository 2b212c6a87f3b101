"""Every plugin seam in one table (``SEAMS``), and ``python -m nanovllm.seams [PLUGIN ...]``, which loads the
plugin files or modules named (as ``plugins=[...]`` does) and prints each seam: its registry, its decorator, its
base class, where its built-ins live and the names registered now.

Each seam is declared the same way, in its own module: a ``Registry`` named in upper-case plural, a
``register_<seam>`` class decorator and the base class the registry checks, all three exported from ``nanovllm``.
Its built-ins live in the modules its registry's ``builtin_packages`` names, imported on the first lookup: a
top-level package named after the seam where they need only the public API (``policies/``, ``allocators/``,
``routers/``, ``proposers/``, ``spec_policies/``), else beside the base class. A front door like ``run``: it
imports the harness for its seam (step-time models), which the core never does.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from nanovllm.allocator import ALLOCATORS, register_allocator
from nanovllm.attention.base import ATTENTION_BACKENDS, register_attention
from nanovllm.cluster.kv_transfer import KV_TRANSFERS, register_kv_transfer
from nanovllm.engine.runner import RUNNERS, register_runner
from nanovllm.eviction import EVICTION_POLICIES, register_eviction
from nanovllm.harness.sim.step_time import STEP_TIME_MODELS, register_step_time
from nanovllm.kv_tiers import KV_TIERS, register_kv_tier
from nanovllm.kv_tiers.offload import OFFLOAD_POLICIES, register_offload_policy
from nanovllm.models.base import MODELS, register_model
from nanovllm.plugins import load_plugins
from nanovllm.policy import POLICIES, register_policy
from nanovllm.proposer import PROPOSERS, register_proposer
from nanovllm.registry import Registry
from nanovllm.router import ROUTERS, register_router
from nanovllm.serving.loggers import LOGGERS, register_logger
from nanovllm.spec_policy import SPEC_POLICIES, register_spec_policy


@dataclass(frozen=True)
class Seam:
    """One plugin seam: what it decides, its registry (and the name ``nanovllm`` exports it under), its decorator,
    and how a run chooses a plugin of it."""

    decides: str
    name: str
    registry: Registry[Any]
    register: Callable[[str], Callable[[type], type]]
    chosen_by: str

    @property
    def base(self) -> type:
        """The base class every plugin of this seam subclasses."""
        assert self.registry.base is not None
        return self.registry.base


SEAMS: tuple[Seam, ...] = (
    Seam("scheduling policy", "POLICIES", POLICIES, register_policy, "scheduler=NAME, LLM(scheduler=...)"),
    Seam("KV block allocator", "ALLOCATORS", ALLOCATORS, register_allocator, "allocator=NAME, LLM(allocator=...)"),
    Seam("eviction order", "EVICTION_POLICIES", EVICTION_POLICIES, register_eviction, "allocator.eviction=NAME"),
    Seam("KV tier", "KV_TIERS", KV_TIERS, register_kv_tier, "kv_offload=NAME, LLM(kv_offload=...)"),
    Seam("KV offload policy", "OFFLOAD_POLICIES", OFFLOAD_POLICIES, register_offload_policy,
         "kv_offload.policy=NAME"),
    Seam("attention backend", "ATTENTION_BACKENDS", ATTENTION_BACKENDS, register_attention,
         "attention=NAME, LLM(attention=...)"),
    Seam("model architecture", "MODELS", MODELS, register_model, "the checkpoint's config.json `architectures`"),
    Seam("step runner", "RUNNERS", RUNNERS, register_runner, "runner=NAME, LLMEngine(runner=...)"),
    Seam("router", "ROUTERS", ROUTERS, register_router, "router=NAME with cluster.replicas=N"),
    Seam("KV transfer", "KV_TRANSFERS", KV_TRANSFERS, register_kv_transfer,
         "kv_transfer=NAME with prefill/decode pools"),
    Seam("step-time model", "STEP_TIME_MODELS", STEP_TIME_MODELS, register_step_time,
         "runner=sim runner.step_time=NAME"),
    Seam("run logger", "LOGGERS", LOGGERS, register_logger, "logger=NAME"),
    Seam("speculative proposer", "PROPOSERS", PROPOSERS, register_proposer,
         "speculative=NAME, LLM(speculative=dict(method=NAME, num_speculative_tokens=K))"),
    Seam("speculation policy", "SPEC_POLICIES", SPEC_POLICIES, register_spec_policy,
         "speculative.policy=NAME, LLM(speculative=dict(..., policy=NAME))"),
)


def describe(seams: tuple[Seam, ...] = SEAMS) -> str:
    """The listing ``python -m nanovllm.seams`` prints: one paragraph per seam."""
    paragraphs = []
    for seam in seams:
        base = seam.base
        paragraphs.append("\n".join([
            f"{seam.decides}: {seam.name}, @{seam.register.__name__}, subclass "
            f"{base.__module__}.{base.__qualname__}",
            f"  built-ins in: {', '.join(seam.registry.builtin_packages)}",
            f"  chosen by:    {seam.chosen_by}",
            f"  registered:   {', '.join(seam.registry.names())}",
        ]))
    return "\n\n".join(paragraphs)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m nanovllm.seams``."""
    parser = argparse.ArgumentParser(prog="python -m nanovllm.seams", description=__doc__.split("\n\n")[0])
    parser.add_argument("plugins", nargs="*", help="plugin files or modules to load first (as plugins=[...])")
    args = parser.parse_args(argv)
    load_plugins(args.plugins)
    print(describe())


if __name__ == "__main__":
    main()
