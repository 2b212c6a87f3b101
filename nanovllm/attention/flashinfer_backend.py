"""``attention=flashinfer``: FlashInfer's paged-KV kernels on CUDA (``pip install -e '.[gpu]'``).

One step is planned once (``plan``) from ``AttentionMetadata`` through the pure translation in
``flashinfer_plan.plan_arguments``; every layer then writes its new K/V into the paged cache and runs the
planned wrapper:
- a step whose every sequence has one query token (decodes, and one-token prefill chunks) uses
  ``BatchDecodeWithPagedKVCacheWrapper``;
- any other step (prefills, chunks on top of cached tokens, decodes mixed in) uses
  ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``, whose mask aligns each chunk's queries with
  the last positions of its KV sequence, i.e. a chunk on top of ``c`` cached tokens sees them all.
GQA is the kernels' own (``num_qo_heads`` a multiple of ``num_kv_heads``).

KV layout: ``NHD``. The engine's cache (nanovllm/engine/kv_cache.py) is, per layer, K and V tensors of
``[num_blocks, block_size, num_kv_heads, head_dim]``, which is FlashInfer's NHD page layout
``[max_num_pages, page_size, num_kv_heads, head_dim]`` as a ``(k_cache, v_cache)`` tuple, so the kernels read
the same cache the torch backend does, with no copy or transpose. FlashInfer's docs report no significant
speed difference between NHD and HND for 16-bit caches (HND helps fp8 caches, which we do not have).

The workspace (128 MiB, FlashInfer's recommended size) is allocated once, when the cache is bound, and shared
by every wrapper; they never run concurrently. For CUDA-graph decode each captured batch size gets its own
decode wrapper in CUDA-graph mode over fixed index buffers (``prepare_cuda_graphs``), re-planned before each
replay (``plan_cuda_graph``). ``flashinfer`` is imported only when a cache is bound, so the package is
optional and this module imports on any machine.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from nanovllm.attention.base import AttentionBackend, AttentionMetadata, register_attention
from nanovllm.attention.flashinfer_plan import PagedKVPlan, plan_arguments

KV_LAYOUT = "NHD"
WORKSPACE_BYTES = 128 * 1024 * 1024
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


@register_attention("flashinfer")
class FlashInferAttention(AttentionBackend):
    supports_cuda_graphs = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        # FlashInfer's CUDA-core decode kernels exist for query groups of 1, 2, 3, 4 and 8 heads per KV head;
        # larger groups run faster on its tensor-core path, which takes any group size.
        self.use_tensor_cores = num_heads // num_kv_heads > 4
        self._flashinfer: Any = None
        self._workspace: torch.Tensor | None = None
        self._prefill: Any = None
        self._decode: Any = None
        self._active: Any = None                         # the wrapper planned for this step
        self._slot_mapping: torch.Tensor | None = None
        self._graph_decode: dict[int, Any] = {}         # captured batch size -> its CUDA-graph decode wrapper
        self._graph_slots: torch.Tensor | None = None   # fixed slot-mapping buffer the graphs read

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        if device.type != "cuda" or not torch.cuda.is_available():
            return "FlashInfer's kernels need a CUDA device (use attention=torch on CPU)"
        if importlib.util.find_spec("flashinfer") is None:
            return "the flashinfer package is not installed: pip install -e '.[gpu]'"
        return None

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        k_cache = kv_caches[0][0]
        if k_cache.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"attention=flashinfer needs dtype float16 or bfloat16 (FlashInfer has no float32 "
                             f"kernels), got {str(k_cache.dtype).removeprefix('torch.')}")
        super().bind_kv_caches(kv_caches)
        import flashinfer

        self._flashinfer = flashinfer
        # Zero-filled: FlashInfer asks for a workspace initialised to 0 before its first use.
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=k_cache.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, KV_LAYOUT)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, KV_LAYOUT, use_tensor_cores=self.use_tensor_cores
        )

    # -- planning ----------------------------------------------------------------------------------------------
    def plan(self, meta: AttentionMetadata) -> None:
        args = plan_arguments(meta)
        self._slot_mapping = meta.slot_mapping
        if args.is_decode:
            self._plan_decode(self._decode, args)
            self._active = self._decode
            return
        self._prefill.plan(
            args.qo_indptr, args.kv_indptr, args.kv_indices, args.kv_last_page_len,
            self.num_heads, self.num_kv_heads, self.head_dim, args.page_size,
            causal=True, sm_scale=self.scale, q_data_type=self._dtype, kv_data_type=self._dtype,
        )
        self._active = self._prefill

    def _plan_decode(self, wrapper: Any, args: PagedKVPlan) -> None:
        wrapper.plan(
            args.kv_indptr, args.kv_indices, args.kv_last_page_len,
            self.num_heads, self.num_kv_heads, self.head_dim, args.page_size,
            sm_scale=self.scale, q_data_type=self._dtype, kv_data_type=self._dtype,
        )

    @property
    def _dtype(self) -> torch.dtype:
        return self.kv_caches[0][0].dtype

    # -- CUDA-graph decode -------------------------------------------------------------------------------------
    def prepare_cuda_graphs(self, batch_sizes: list[int], max_num_pages: int) -> None:
        assert self._workspace is not None, "bind_kv_caches() runs before prepare_cuda_graphs()"
        device = self._workspace.device
        top = max(batch_sizes)
        self._graph_slots = torch.zeros(top, dtype=torch.long, device=device)
        indptr = torch.zeros(top + 1, dtype=torch.int32, device=device)
        indices = torch.zeros(max_num_pages, dtype=torch.int32, device=device)
        last_page_len = torch.zeros(top, dtype=torch.int32, device=device)
        # Each size reads views of the same buffers: only one graph replays at a time.
        self._graph_decode = {
            size: self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, KV_LAYOUT, use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=indptr[: size + 1], paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last_page_len[:size],
            )
            for size in batch_sizes
        }

    def plan_cuda_graph(self, meta: AttentionMetadata, batch_size: int) -> None:
        assert self._graph_slots is not None, "prepare_cuda_graphs() runs before plan_cuda_graph()"
        self._graph_slots[:batch_size].copy_(meta.slot_mapping)
        self._slot_mapping = self._graph_slots[:batch_size]
        wrapper = self._graph_decode[batch_size]
        self._plan_decode(wrapper, plan_arguments(meta))
        self._active = wrapper

    # -- the per-layer call ------------------------------------------------------------------------------------
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer]
        slots = self._slot_mapping
        assert slots is not None, "plan() runs before forward()"
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v.to(v_cache.dtype))
        out = self._active.run(q.contiguous(), (k_cache, v_cache))
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
