"""nano-vllm: a small, readable LLM inference engine whose every serving decision is a plugin.

The public names below are imported on first use (PEP 562), so ``import nanovllm`` itself stays light: plugin
modules load fast, and ``python -m nanovllm.run`` can install its Ctrl-C handling before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nanovllm import machine

machine.apply_isa_cap()  # before anything imports torch: a forced lower ISA level caps oneDNN and ATen too

# name -> the module it lives in
_EXPORTS = {
    "LLM": "nanovllm.llm",
    "LLMEngine": "nanovllm.engine.engine",
    "SamplingParams": "nanovllm.sampling",
    "RequestOutput": "nanovllm.outputs",
    "RequestMetrics": "nanovllm.outputs",
    "EngineConfig": "nanovllm.config",
    "Policy": "nanovllm.policy",
    "SchedulerView": "nanovllm.policy",
    "StepBudget": "nanovllm.policy",
    "register_policy": "nanovllm.policy",
    "a_hair_before": "nanovllm.policy",
    "POLICIES": "nanovllm.policy",
    "EvictionTracker": "nanovllm.eviction",
    "EvictionPolicy": "nanovllm.eviction",
    "register_eviction": "nanovllm.eviction",
    "EVICTION_POLICIES": "nanovllm.eviction",
    "BlockAllocator": "nanovllm.allocator",
    "register_allocator": "nanovllm.allocator",
    "ALLOCATORS": "nanovllm.allocator",
    "prefix_block_key": "nanovllm.allocator",
    "KVTier": "nanovllm.kv_tiers",
    "TierContext": "nanovllm.kv_tiers",
    "register_kv_tier": "nanovllm.kv_tiers",
    "KV_TIERS": "nanovllm.kv_tiers",
    "OffloadPolicy": "nanovllm.kv_tiers.offload",
    "register_offload_policy": "nanovllm.kv_tiers.offload",
    "OFFLOAD_POLICIES": "nanovllm.kv_tiers.offload",
    "EvictedBlock": "nanovllm.allocator",
    "AttentionBackend": "nanovllm.attention.base",
    "AttentionMetadata": "nanovllm.attention.base",
    "register_attention": "nanovllm.attention.base",
    "ATTENTION_BACKENDS": "nanovllm.attention.base",
    "Runner": "nanovllm.engine.runner",
    "RunnerContext": "nanovllm.engine.runner",
    "register_runner": "nanovllm.engine.runner",
    "RUNNERS": "nanovllm.engine.runner",
    "Router": "nanovllm.router",
    "ReplicaView": "nanovllm.router",
    "RouterError": "nanovllm.router",
    "register_router": "nanovllm.router",
    "live_replicas": "nanovllm.router",
    "ROUTERS": "nanovllm.router",
    "KVTransfer": "nanovllm.cluster.kv_transfer",
    "register_kv_transfer": "nanovllm.cluster.kv_transfer",
    "KV_TRANSFERS": "nanovllm.cluster.kv_transfer",
    "CausalLM": "nanovllm.models.base",
    "register_model": "nanovllm.models.base",
    "MODELS": "nanovllm.models.base",
    # The harness's seam: imported only when asked for, and left out of the TYPE_CHECKING block below, which
    # import-linter reads as an import (every core module that imports nanovllm would then reach the harness).
    "StepTimeModel": "nanovllm.harness.sim.step_time",
    "register_step_time": "nanovllm.harness.sim.step_time",
    "STEP_TIME_MODELS": "nanovllm.harness.sim.step_time",
    # The serving layer's seam (run loggers), imported only when asked for: it loads numpy and the records.
    "RunLogger": "nanovllm.serving.loggers",
    "register_logger": "nanovllm.serving.loggers",
    "LOGGERS": "nanovllm.serving.loggers",
    "Proposer": "nanovllm.proposer",
    "ProposerContext": "nanovllm.proposer",
    "register_proposer": "nanovllm.proposer",
    "PROPOSERS": "nanovllm.proposer",
    "DraftModel": "nanovllm.engine.draft_model",
    "SpeculationPolicy": "nanovllm.spec_policy",
    "SpeculationState": "nanovllm.spec_policy",
    "StepCost": "nanovllm.spec_policy",
    "register_spec_policy": "nanovllm.spec_policy",
    "SPEC_POLICIES": "nanovllm.spec_policy",
    "Registry": "nanovllm.registry",
    "load_plugins": "nanovllm.plugins",
    "PluginImportError": "nanovllm.plugins",
    "UnknownPluginError": "nanovllm.registry",
    "Request": "nanovllm.request",
    "RequestStatus": "nanovllm.request",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see
    from nanovllm.allocator import ALLOCATORS, BlockAllocator, EvictedBlock, register_allocator
    from nanovllm.attention.base import ATTENTION_BACKENDS, AttentionBackend, AttentionMetadata, register_attention
    from nanovllm.cluster.kv_transfer import KV_TRANSFERS, KVTransfer, register_kv_transfer
    from nanovllm.config import EngineConfig
    from nanovllm.engine.draft_model import DraftModel
    from nanovllm.engine.engine import LLMEngine
    from nanovllm.engine.runner import RUNNERS, Runner, RunnerContext, register_runner
    from nanovllm.eviction import EVICTION_POLICIES, EvictionPolicy, EvictionTracker, register_eviction
    from nanovllm.kv_tiers import KV_TIERS, KVTier, TierContext, register_kv_tier
    from nanovllm.kv_tiers.offload import OFFLOAD_POLICIES, OffloadPolicy, register_offload_policy
    from nanovllm.llm import LLM
    from nanovllm.models.base import MODELS, CausalLM, register_model
    from nanovllm.outputs import RequestMetrics, RequestOutput
    from nanovllm.plugins import PluginImportError, load_plugins
    from nanovllm.policy import POLICIES, Policy, SchedulerView, StepBudget, a_hair_before, register_policy
    from nanovllm.proposer import PROPOSERS, Proposer, ProposerContext, register_proposer
    from nanovllm.registry import Registry, UnknownPluginError
    from nanovllm.request import Request, RequestStatus
    from nanovllm.router import ROUTERS, ReplicaView, Router, RouterError, live_replicas, register_router
    from nanovllm.sampling import SamplingParams
    from nanovllm.spec_policy import (SPEC_POLICIES, SpeculationPolicy, SpeculationState, StepCost,
                                      register_spec_policy)
