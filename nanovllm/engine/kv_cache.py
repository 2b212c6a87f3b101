"""The one preallocated KV tensor, and how many blocks it gets."""

from __future__ import annotations

import torch

from nanovllm.attention.kv_quant import row_elements, storage_dtype
from nanovllm.config import EngineConfig


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                    kv_cache_dtype: str = "auto") -> int:
    """K and V of ``block_size`` tokens in every layer, for a model in ``dtype``: model-dtype values for
    ``kv_cache_dtype="auto"``, else one byte per value plus each row's float32 scale (``kv_quant``)."""
    element = torch.empty((), dtype=storage_dtype(kv_cache_dtype, dtype)).element_size()
    return 2 * num_layers * block_size * num_kv_heads * row_elements(head_dim, kv_cache_dtype) * element


def available_memory(device: torch.device) -> int:
    """Bytes free on ``device`` now (MemAvailable on CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; set num_kv_blocks or kv_cache_memory")


def decide_num_blocks(config: EngineConfig, block_bytes: int, max_model_len: int, device: torch.device) -> int:
    """``num_kv_blocks`` if given; else the memory budget divided by the block size, capped at what
    ``max_num_seqs`` requests of ``max_model_len`` tokens could ever use."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = config.kv_cache_memory or int(available_memory(device) * config.kv_cache_fraction)
    cap = config.max_num_seqs * -(-max_model_len // config.block_size)
    num_blocks = min(budget // block_bytes, cap)
    if num_blocks < 1:
        raise ValueError(f"the KV cache budget ({budget} bytes) is smaller than one block ({block_bytes} bytes)")
    return num_blocks


def allocate_kv_cache(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device, kv_cache_dtype: str = "auto",
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One tensor [layers, 2, blocks, block_size, kv_heads, head_dim] and its per-layer (K, V) views; an 8-bit
    cache's rows are ``head_dim + 4`` wide (the codes, then the scale's bytes: ``kv_quant``). Zero-filled, so
    padded key slots never hold NaN bit patterns (and an 8-bit row starts with scale 0)."""
    cache = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, row_elements(head_dim, kv_cache_dtype),
                        dtype=storage_dtype(kv_cache_dtype, dtype), device=device)
    return cache, [(cache[layer, 0], cache[layer, 1]) for layer in range(num_layers)]
