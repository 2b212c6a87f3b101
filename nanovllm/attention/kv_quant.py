"""8-bit KV caches (``kv_cache_dtype=int8`` or ``fp8_e4m3``): the storage layout and the quantization both
attention backends (``cpu``'s C++ kernel and the ``torch`` reference) follow, so either can read what the other
wrote.

Layout: each cache row, one token's one KV head, is ``head_dim`` 8-bit values followed by the 4 bytes of its
float32 scale, ``[num_blocks, block_size, num_kv_heads, head_dim + 4]``. The scale travels inside the row, so
every copy of blocks (``Runner.read_kv``/``write_kv``, the KV-transfer seam, index_select over blocks) carries
its scales without knowing about them, and ``bytes_per_block`` counts them by counting elements.

Scales: symmetric, one per (token, KV head): ``scale = max|x| / QMAX`` of that head's vector, written with the
token. A token's scale never changes afterwards, so appending to a block never re-quantizes what the block
holds (a per-block scale would have to grow, and re-round, the block's earlier tokens), and an outlier token
costs only its own precision. The price is 4 bytes per 64-wide head row: the cache holds 128 / 68 = 1.88x the
tokens of a bfloat16 one (1.94x at head_dim 128), not 2x.

* ``int8``: ``q = round_half_even(x / scale)`` clamped to [-127, 127] (QMAX 127); storage dtype ``torch.int8``.
* ``fp8_e4m3``: ``q = float8_e4m3fn(x / scale)`` (QMAX 448, e4m3's largest finite value, so nothing saturates);
  storage dtype ``torch.uint8`` holding the e4m3 bit patterns (torch has no ``index_copy_`` for float8 on CPU).

The two storage dtypes differ on purpose: a cache (or a handed-off copy of one) says its format by its dtype.
Dequantized values are ``float(q) * scale`` in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_BYTES = 4  # one float32 scale per (token, KV head), after the row's head_dim 8-bit values


@dataclass(frozen=True)
class KVFormat:
    """One 8-bit cache format: its ``kv_cache_dtype`` name, storage dtype, payload dtype and largest code."""

    name: str
    storage: torch.dtype    # the cache tensor's dtype
    payload: torch.dtype    # what the head_dim 8-bit values are, viewed as such
    qmax: float             # |code| at most: max|x| maps to it


FORMATS: dict[str, KVFormat] = {
    "int8": KVFormat("int8", torch.int8, torch.int8, 127.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.uint8, torch.float8_e4m3fn, 448.0),
}


def kv_format(kv_cache_dtype: str) -> KVFormat | None:
    """The 8-bit format ``kv_cache_dtype`` names, or None for ``auto`` (the cache holds the model dtype)."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype not in FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(FORMATS)}, got {kv_cache_dtype!r}")
    return FORMATS[kv_cache_dtype]


def format_of_cache(cache: torch.Tensor) -> KVFormat | None:
    """The 8-bit format a cache tensor is stored in (by its dtype), or None for a cache of model-dtype values."""
    for fmt in FORMATS.values():
        if cache.dtype == fmt.storage:
            return fmt
    return None


def quantize(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``x`` [..., head_dim] (any float dtype) as packed cache rows [..., head_dim + 4] of ``fmt.storage``:
    the codes, then the float32 scale's bytes. Called by the torch backend when it writes new K/V; the C++
    kernel does the same arithmetic (``quantize_row`` in ``csrc/paged_attention.cpp``), bit for bit."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / fmt.qmax
    # An all-zero row keeps scale 0 (its codes are 0); dividing by 1 instead avoids 0 / 0.
    scaled = xf / torch.where(scale > 0, scale, torch.ones_like(scale))
    if fmt.payload == torch.int8:
        codes = scaled.round().clamp(-fmt.qmax, fmt.qmax).to(torch.int8).view(fmt.storage)
    else:
        codes = scaled.clamp(-fmt.qmax, fmt.qmax).to(fmt.payload).view(fmt.storage)
    return torch.cat([codes, scale.contiguous().view(fmt.storage)], dim=-1)


def dequantize(packed: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Packed cache rows [..., head_dim + 4] as float32 values [..., head_dim]. Called by the torch backend
    on the blocks it gathers for attention."""
    head_dim = packed.shape[-1] - SCALE_BYTES
    codes = packed[..., :head_dim].view(fmt.payload).float()
    scale = packed[..., head_dim:].contiguous().view(torch.float32)
    return codes * scale


def row_elements(head_dim: int, kv_cache_dtype: str) -> int:
    """Elements of one cache row (one token's one KV head): ``head_dim``, plus the scale's bytes when 8-bit."""
    return head_dim + (SCALE_BYTES if kv_format(kv_cache_dtype) is not None else 0)


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype: the model's for ``auto``, else the 8-bit format's storage dtype."""
    fmt = kv_format(kv_cache_dtype)
    return model_dtype if fmt is None else fmt.storage
