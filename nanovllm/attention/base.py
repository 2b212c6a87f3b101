"""The attention seam. A backend is planned once per step from the batch layout (``AttentionMetadata``) and
then called by every layer: it writes the step's new K/V into the paged cache and attends over the cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from nanovllm.attention.kv_quant import format_of_cache
from nanovllm.registry import Registry


@dataclass
class AttentionMetadata:
    """The flat batch of one step, built once by the model runner and handed to the backend's ``plan``.

    Sequences are concatenated in batch order: sequence ``i`` contributes ``query_lens[i]`` consecutive rows
    of the flat batch (its rows start at ``sum(query_lens[:i])``), which are the tokens at positions
    ``num_computed[i] .. seq_lens[i]-1`` of that sequence; its keys and values for positions
    ``0 .. seq_lens[i]-1`` live in the paged cache at the blocks ``block_tables[i]`` (position ``p`` in block
    ``block_tables[i][p // block_size]``, offset ``p % block_size``). ``slot_mapping`` is the one tensor
    (on the model's device); the rest are Python lists so each backend builds the index tensors it needs.
    """

    query_lens: list[int]
    seq_lens: list[int]             # context length after this step (cached + new tokens)
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor      # [num_tokens] cache slot (block * block_size + offset) of each new token
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_computed(self) -> list[int]:
        return [s - q for s, q in zip(self.seq_lens, self.query_lens)]


class AttentionBackend(ABC):
    """Paged attention for one model. ``kv_caches[layer] = (k_cache, v_cache)``, each of shape
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype, or, for an 8-bit cache
    (``kv_cache_dtype``), ``[..., head_dim + 4]`` packed rows of ``nanovllm.attention.kv_quant``."""

    registered_name: str = "custom"
    # The EngineConfig.kv_cache_dtype values this backend reads and writes; the engine refuses the others
    # before loading the model (``check_kv_cache_dtype``).
    kv_cache_dtypes: tuple[str, ...] = ("auto",)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    # CUDA-graph decode (nanovllm/engine/cuda_graphs.py) replays captured kernels, so every tensor the layers
    # read must stay at one address from step to step. A backend that keeps to that in ``plan_cuda_graph``
    # says so here; the engine runs every step of the others eagerly.
    supports_cuda_graphs: bool = False

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device`` (e.g. FlashInfer needs CUDA and its package), or None."""
        return None

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        """Whether this backend can run on ``device``."""
        return cls.unavailable_reason(device) is None

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Called once by the runner after it allocated the cache: the per-layer (K, V) views to write and read.
        An 8-bit cache says its format by its dtype (``kv_quant.format_of_cache``)."""
        fmt = format_of_cache(kv_caches[0][0]) if kv_caches else None
        if fmt is not None and fmt.name not in self.kv_cache_dtypes:
            raise ValueError(f"kv_cache_dtype={fmt.name!r} is not supported by attention backend "
                             f"{self.registered_name!r} (supported: {', '.join(self.kv_cache_dtypes)})")
        self.kv_caches = kv_caches

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare everything the per-layer calls of this step share (index tensors, masks, kernel plans)."""

    def prepare_cuda_graphs(self, batch_sizes: list[int], max_num_pages: int) -> None:
        """Called once before decode graphs of ``batch_sizes`` are captured: allocate the fixed buffers they
        will read (``max_num_pages`` bounds the pages of one batch). Nothing to allocate by default."""

    def plan_cuda_graph(self, meta: AttentionMetadata, batch_size: int) -> None:
        """Plan a decode-only step already padded to ``batch_size`` rows for the graph captured at that size,
        writing only into fixed buffers. The default plans as usual, which is right only where ``plan``
        allocates nothing the layers read (on CPU, with the test double of a graph)."""
        self.plan(meta)

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write ``k``/``v`` ([T, num_kv_heads, head_dim]) into layer ``layer``'s cache at the planned slots,
        then attend: ``q`` is [T, num_heads, head_dim]; returns [T, num_heads * head_dim]."""


ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry(
    "attention backend", base=AttentionBackend, builtin_packages=("nanovllm.attention",),
    engine_args=("num_heads", "num_kv_heads", "head_dim", "scale"),
)


def register_attention(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    """Class decorator registering an ``AttentionBackend`` subclass under ``name`` (``attention.name=<name>``)."""
    return ATTENTION_BACKENDS.register(name)


AUTO = "auto"


def default_attention_name(device: torch.device | str) -> str:
    """What ``attention="auto"`` (the default) means on ``device``: the C++ kernel on CPU, the torch reference
    elsewhere."""
    return "cpu" if torch.device(device).type == "cpu" else "torch"


def resolve_attention(spec: Any, device: torch.device | str) -> Any:
    """``spec`` (a name, a ``{"name": ...}`` mapping or an instance) with the name ``auto`` resolved for
    ``device``; anything else is returned as is."""
    if isinstance(spec, str) and spec == AUTO:
        return default_attention_name(device)
    if isinstance(spec, Mapping) and spec.get("name") == AUTO:
        return {**spec, "name": default_attention_name(device)}
    return spec


def attention_class(spec: Any) -> type[AttentionBackend] | None:
    """The backend class ``spec`` stands for (a registered name, a ``{"name": ...}`` mapping or an instance;
    ``auto`` already resolved), or None for a spec that names none (``Registry.check`` reports those)."""
    if isinstance(spec, AttentionBackend):
        return type(spec)
    name = spec if isinstance(spec, str) else spec.get("name") if isinstance(spec, Mapping) else None
    return ATTENTION_BACKENDS.get(name) if isinstance(name, str) and name else None


def check_attention_available(spec: Any, device: torch.device | str) -> None:
    """Raise ``ValueError`` saying why when the backend ``spec`` names cannot run on ``device`` (FlashInfer on
    a CPU machine): asked of the class, so it is known before any model or kernel loads."""
    device = torch.device(device)
    spec = resolve_attention(spec, device)
    cls = attention_class(spec)
    if cls is None:
        return
    backend = spec if isinstance(spec, AttentionBackend) else cls
    if not backend.is_available(device):
        reason = backend.unavailable_reason(device) or "the backend says it is not available there"
        raise ValueError(f"attention backend {cls.registered_name!r} cannot run on {device}: {reason}")


def check_kv_cache_dtype(spec: Any, kv_cache_dtype: str, device: torch.device | str) -> None:
    """Raise ``ValueError`` naming ``kv_cache_dtype`` when the backend ``spec`` names does not read and write
    that cache format (``AttentionBackend.kv_cache_dtypes``): checked before the model loads."""
    cls = attention_class(resolve_attention(spec, torch.device(device)))
    if cls is not None and kv_cache_dtype not in cls.kv_cache_dtypes:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported by attention backend "
                         f"{cls.registered_name!r} (supported: {', '.join(cls.kv_cache_dtypes)}); use "
                         "attention=cpu or attention=torch, or kv_cache_dtype=auto")
