"""nano-vllm: a small, readable LLM inference engine whose every serving decision is a plugin."""

from nanovllm import machine

machine.apply_isa_cap()  # before anything imports torch: a forced lower ISA level caps oneDNN and ATen too


from nanovllm.allocator import ALLOCATORS, BlockAllocator, register_allocator
from nanovllm.attention.base import ATTENTION_BACKENDS, AttentionBackend, AttentionMetadata, register_attention
from nanovllm.config import EngineConfig
from nanovllm.outputs import RequestMetrics, RequestOutput
from nanovllm.eviction import EVICTION_POLICIES, EvictionTracker
from nanovllm.policy import POLICIES, Policy, SchedulerView, StepBudget, register_policy
from nanovllm.registry import Registry, UnknownPluginError
from nanovllm.request import Request, RequestStatus
from nanovllm.sampling import SamplingParams


def __getattr__(name: str):
    # LLM pulls in transformers and the engine; import it on first use so plugin modules load fast.
    if name in ("LLM", "LLMEngine"):
        from nanovllm.llm import LLM
        from nanovllm.engine.engine import LLMEngine
        return {"LLM": LLM, "LLMEngine": LLMEngine}[name]
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")


__all__ = [
    "LLM", "LLMEngine", "SamplingParams", "RequestOutput", "RequestMetrics", "EngineConfig",
    "Policy", "SchedulerView", "StepBudget", "EvictionTracker", "EVICTION_POLICIES", "BlockAllocator", "AttentionBackend", "AttentionMetadata",
    "register_policy", "register_allocator", "register_attention",
    "POLICIES", "ALLOCATORS", "ATTENTION_BACKENDS", "Registry", "UnknownPluginError", "Request", "RequestStatus",
]
