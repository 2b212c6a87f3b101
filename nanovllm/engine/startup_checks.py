"""What ``LLMEngine`` can tell is impossible before it loads the model: checked from the engine config, the
model's HF config (cheap: one JSON file) and the plugin specs, so a bad option fails in a second rather than
after the weights and the C++ kernels have loaded."""

from __future__ import annotations

from typing import Any

import torch

from nanovllm.allocator import ALLOCATORS
from nanovllm.attention.base import (ATTENTION_BACKENDS, check_attention_available, check_kv_cache_dtype,
                                     resolve_attention)
from nanovllm.config import EngineConfig, head_dim_of, torch_dtype
from nanovllm.engine.kv_cache import bytes_per_block, decide_num_blocks
from nanovllm.models.parallel import head_shard
from nanovllm.policy import POLICIES


def check_before_load(config: EngineConfig, hf_config: Any, max_model_len: int, scheduler: Any, allocator: Any,
                      attention: Any, device: torch.device, loads_model: bool) -> None:
    """Raise what ``LLMEngine.__init__`` would raise after the load, now: an unknown scheduler, allocator or
    attention name or option, or a bad scheduler or allocator option value; an attention backend that cannot
    run on ``device`` or does not support ``kv_cache_dtype``; a ``kv_cache_memory`` smaller than one KV block. A runner that loads no model (``sim``)
    runs no attention and holds no KV tensor: only the specs are checked."""
    # Throwaway instances, as python -m nanovllm.run builds them: their constructors check option values (an
    # eviction or predictor name) with the messages LLMEngine gave after the load. An instance passes as is.
    POLICIES.build(scheduler)
    ALLOCATORS.build(allocator, 1, config.block_size)
    attention = resolve_attention(attention, device)
    ATTENTION_BACKENDS.check(attention)
    if not loads_model:
        return
    check_attention_available(attention, device)
    check_kv_cache_dtype(attention, config.kv_cache_dtype, device)
    if config.num_kv_blocks is None and config.kv_cache_memory is not None:
        decide_num_blocks(config, _block_bytes(config, hf_config), max_model_len, device)  # raises if < 1 block


def _block_bytes(config: EngineConfig, hf_config: Any) -> int:
    """One KV block's bytes as the runner will size it (rank 0's KV heads under tensor parallelism)."""
    num_kv_heads = hf_config.num_key_value_heads
    if config.tensor_parallel_size > 1:  # head_shard checks that the heads split over the ranks
        num_kv_heads = head_shard(hf_config.num_attention_heads, num_kv_heads, 0,
                                  config.tensor_parallel_size).num_kv_heads
    return bytes_per_block(hf_config.num_hidden_layers, num_kv_heads, head_dim_of(hf_config), config.block_size,
                           torch_dtype(config.dtype), config.kv_cache_dtype)
