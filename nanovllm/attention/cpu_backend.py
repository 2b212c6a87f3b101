"""Fast paged attention for CPU: a small C++ kernel (``nanovllm/csrc/paged_attention.cpp``, built and cached by
``nanovllm.kernels`` on first use).

Why a C++ kernel and not SDPA or FlexAttention: a decode step is one query row per sequence against ~100-1000
cached keys. The reference backend gathers every sequence's blocks into a padded rectangle and builds a mask,
and that copying, not arithmetic, is what the step pays for; FlexAttention on CPU compiles per shape and still
works on padded rectangles. The kernel reads keys straight from the block table, so a step costs what its
query-key pairs cost. One kernel call per layer also writes the new K/V into the cache.

``plan`` builds, once per step, the only metadata the kernel needs: each token's sequence index and absolute
position, and the block tables as one int32 tensor. Prefill chunks over a cached prefix are ordinary tokens
whose position says how many keys they see. GQA: each kernel work item serves all query heads of one KV head.
On AVX-512 CPUs the kernel's vectorized path (16 keys at a time, scores reduced together, accumulators in
registers; for bf16 caches both products on the AVX-512 BF16 dot-product instruction) also beats SDPA on long
prefill chunks (``experiments/bench_attention.py``; docs/speed.md has the measurement and its machine), so by
default every token goes to the kernel. ``sdpa_min_query`` sends long chunks to
SDPA instead, which can pay on CPUs without AVX-512, where the kernel runs its plain loop.

8-bit caches (``kv_cache_dtype=int8`` / ``fp8_e4m3``, layout in ``kv_quant``) go to the kernel's
``paged_attention_8bit``: it quantizes the new K/V rows as it writes them and reads each cached row inside its
attention loop: for bfloat16 models on AVX-512 BF16 CPUs the bf16 dot-product kernel (int8 codes in int16 integer
products, e4m3 codes as bf16), else the float32 AVX-512 kernel (16 keys a tile, as above) on the AVX-512 builds,
the AVX2 kernel on the avx2 build, and a portable, compiler-vectorized loop on the others (docs/kv_cache_dtype.md).
"""

from __future__ import annotations

import torch

from nanovllm import kernels
from nanovllm.attention import kv_quant
from nanovllm.attention.base import AttentionBackend, AttentionMetadata, register_attention
from nanovllm.attention.torch_backend import _Group, attend_padded_group, plan_padded_group


@register_attention("cpu")
class CpuAttention(AttentionBackend):
    """Paged attention on CPU through the C++ kernel; float32, bfloat16 and float16 caches, and 8-bit ones
    (int8, fp8_e4m3) for a model in any of those dtypes.

    ``sdpa_min_query``: None (the default) runs every token through the kernel. An integer sends sequences
    with at least that many query tokens in the step (long prefill chunks) through torch's SDPA on a padded
    group instead, as in the reference backend, for CPUs where the kernel's plain (non-AVX-512) loop is slower
    than SDPA's blocked matrix-matrix work.

    ``isa``: the kernel build to run (``nanovllm.machine`` levels: ``avx512_bf16``, ``avx512``, ``avx2``,
    ``scalar``); None, the default, runs the level in force (the CPU's best, or ``NANOVLLM_CPU_ISA``).
    """

    kv_cache_dtypes = ("auto", *kv_quant.FORMATS)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sdpa_min_query: int | None = None, isa: str | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        if sdpa_min_query is not None and (not isinstance(sdpa_min_query, int) or isinstance(sdpa_min_query, bool)
                                           or sdpa_min_query < 2):
            raise ValueError(f"sdpa_min_query must be None or an integer >= 2, got {sdpa_min_query!r}")
        self.sdpa_min_query = sdpa_min_query
        self._kernel = kernels.load(isa)
        self._slot_mapping = torch.empty(0, dtype=torch.long)
        self._block_tables = torch.empty(0, 0, dtype=torch.int32)
        self._seq = torch.empty(0, dtype=torch.int32)
        self._pos = torch.empty(0, dtype=torch.int32)
        self._kernel_rows: torch.Tensor | None = None  # flat rows the kernel attends (None: all of them)
        self._sdpa_group: _Group | None = None  # the long sequences SDPA attends (with _kernel_rows)
        self._stack_caches: tuple | None = None  # kernel_step()'s split of kv_caches, keyed by the list bound

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        return torch.device(device).type == "cpu"

    def plan(self, meta: AttentionMetadata) -> None:
        query_lens = torch.tensor(meta.query_lens, dtype=torch.int32)
        seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
        seq = torch.repeat_interleave(torch.arange(meta.num_seqs, dtype=torch.int32), query_lens)
        # Token j of sequence i's chunk sits at position seq_lens[i] - query_lens[i] + j and sees that many
        # keys plus itself.
        starts = torch.cumsum(query_lens, 0) - query_lens
        offsets = torch.arange(int(query_lens.sum()), dtype=torch.int32) - starts[seq]
        pos = ((seq_lens - query_lens)[seq] + offsets).to(torch.int32)
        width = max(len(t) for t in meta.block_tables)
        self._block_tables = torch.tensor([t + [0] * (width - len(t)) for t in meta.block_tables], dtype=torch.int32)
        self._slot_mapping = meta.slot_mapping
        min_query = self.sdpa_min_query
        long_seqs = [] if min_query is None else [i for i, q in enumerate(meta.query_lens) if q >= min_query]
        if min_query is None or not long_seqs:
            self._kernel_rows, self._sdpa_group = None, None
            self._seq, self._pos = seq, pos
            return
        on_kernel = query_lens[seq.long()] < min_query
        self._kernel_rows = on_kernel.nonzero().view(-1)
        self._seq, self._pos = seq[on_kernel], pos[on_kernel]
        self._sdpa_group = plan_padded_group(meta, long_seqs, starts.tolist(), meta.slot_mapping.device)

    def kernel_step(self, kernels) -> tuple | None:
        """This step's attention for the model's C++ decoder stack (``LlamaForCausalLM.forward``, after ``plan``):
        ``(k_caches, v_caches, slot_mapping, block_tables, seq, pos, eight_bit_cache, scale)``, the arguments
        every layer's ``forward`` would pass to the kernel. None where the stack cannot stand in for ``forward``:
        a step with an SDPA group, a kernel build other than ``kernels`` (the model's), or a subclass with its
        own ``forward``."""
        if (self._kernel_rows is not None or self._kernel is not kernels or not self.kv_caches
                or type(self).forward is not CpuAttention.forward):
            return None
        if self._stack_caches is None or self._stack_caches[0] is not self.kv_caches:
            # Split once per bound cache list, not per step.
            self._stack_caches = (self.kv_caches, [k for k, _ in self.kv_caches], [v for _, v in self.kv_caches],
                                  kv_quant.format_of_cache(self.kv_caches[0][0]) is not None)
        _, k_caches, v_caches, eight_bit = self._stack_caches
        return (k_caches, v_caches, self._slot_mapping, self._block_tables, self._seq, self._pos, eight_bit,
                self.scale)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer]
        q_kernel = q if self._kernel_rows is None else q.index_select(0, self._kernel_rows)
        # The kernel writes every new K/V row first, so the SDPA group below reads a complete cache.
        if kv_quant.format_of_cache(k_cache) is None:
            attended = self._kernel.paged_attention(
                q_kernel, k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, self._slot_mapping,
                self._block_tables, self._seq, self._pos, self.scale,
            )
        else:  # k and v stay in the model dtype: the kernel quantizes them into the cache
            attended = self._kernel.paged_attention_8bit(
                q_kernel, k.to(q.dtype), v.to(q.dtype), k_cache, v_cache, self._slot_mapping,
                self._block_tables, self._seq, self._pos, self.scale,
            )
        if self._kernel_rows is None:
            return attended
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        out.index_copy_(0, self._kernel_rows, attended)
        assert self._sdpa_group is not None  # planned with _kernel_rows
        attend_padded_group(self._sdpa_group, q, k_cache, v_cache, self.scale, out)
        return out
