"""The model runner (``runner=real``, the default): turns a scheduled batch into flat tensors once, runs the
model over the paged cache, computes logits only for the rows that sample, and samples."""

from __future__ import annotations

import functools

import numpy as np
import torch

from nanovllm import kernels
from nanovllm.attention.base import AttentionBackend, AttentionMetadata
from nanovllm.config import head_dim_of, torch_dtype
from nanovllm.engine.cuda_graphs import DecodeGraphs, GraphSettings
from nanovllm.engine.kv_cache import allocate_kv_cache
from nanovllm.engine.runner import Runner, RunnerContext, register_runner
from nanovllm.models.base import CausalLM
from nanovllm.engine.speculative import emitted_logprobs, num_proposed, verify_proposals
from nanovllm.models.loader import gguf_source, load_model
from nanovllm.outputs import Logprob
from nanovllm.request import Request
from nanovllm.sampling import Sampler, top_logprobs

# An integer dtype of each element width, for copying K/V bytes through numpy (which has no bfloat16).
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _consecutive_runs(block_ids: list[int], descending: bool) -> list[tuple[int, int, int, bool]]:
    """``block_ids`` as runs (position in the list, lowest block, length, descending) of ids that follow one
    another, ascending, or with ``descending`` also counting down (a pool's free list often hands out blocks
    that way)."""
    runs: list[tuple[int, int, int, bool]] = []
    for j, block in enumerate(block_ids):
        if runs:
            start, low, n, down = runs[-1]
            if (n == 1 or not down) and block == low + n:
                runs[-1] = (start, low, n + 1, False)
                continue
            if descending and (n == 1 or down) and block == low - 1:
                runs[-1] = (start, block, n + 1, True)
                continue
        runs.append((j, block, 1, False))
    return runs


def copy_runs_numpy(cache: torch.Tensor, src: torch.Tensor, block_ids: list[int]) -> None:
    """Blocks ``0:len(block_ids)`` of ``src`` ([layers, 2, n, *block], the cache's dtype) into ``block_ids`` of
    the CPU ``cache``, one numpy copy per run of consecutive pool blocks (counting down too: a negative stride).
    Both sides as integers of the element's width (numpy has no bfloat16), so bit for bit."""
    as_int = _SAME_WIDTH_INT[cache.element_size()]
    pool, blocks = cache.view(as_int).numpy(), src.view(as_int).numpy()
    for j, low, n, down in _consecutive_runs(block_ids, descending=True):
        run = blocks[:, :, j:j + n]
        np.copyto(pool[:, :, low:low + n], run[:, :, ::-1] if down else run)


def kernel_copy_fits(cache: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``copy_kv_blocks`` takes this copy: CPU tensors of one element size with the same block shape,
    each block contiguous in both (the first three dims may have any strides: ``src`` may be a view of a tier's
    slab), and ``src`` not stored in the cache itself (the kernel does not order overlapping copies)."""
    if cache.device.type != "cpu" or src.device.type != "cpu" or cache.dim() < 3 or src.dim() != cache.dim():
        return False
    if src.element_size() != cache.element_size() or src.shape[:2] != cache.shape[:2] \
            or src.shape[3:] != cache.shape[3:]:
        return False
    contiguous: list[int] = []
    step = 1
    for size in reversed(cache.shape[3:]):
        contiguous.insert(0, step)
        step *= size
    if list(cache.stride()[3:]) != contiguous or list(src.stride()[3:]) != contiguous:
        return False
    return src.numel() == 0 or src.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr()


def copy_runs_kernel(compiled: kernels.Kernels, cache: torch.Tensor, src: torch.Tensor,
                     block_ids: list[int]) -> None:
    """``copy_runs_numpy``'s copy in one call of the C++ kernel (``csrc/kv_copy.cpp``: streaming stores, several
    (layer, K/V) slabs copied side by side, their sources prefetched), for a copy ``kernel_copy_fits`` takes."""
    runs = _consecutive_runs(block_ids, descending=True)
    compiled.copy_kv_blocks(cache, src, torch.tensor([(j, low, n, int(down)) for j, low, n, down in runs],
                                                     dtype=torch.long))


@functools.cache
def _copy_kernels() -> kernels.Kernels | None:
    """The compiled kernels for the pool's copies, or None where they cannot be built (numpy copies then)."""
    try:
        return kernels.load()
    except RuntimeError:
        return None


@register_runner("real")
class ModelRunner(Runner):
    """Runs the model for the scheduler's batches: owns the loaded model, the paged KV cache tensor and the
    attention backend bound to it, and the engine's sampling generator. ``execute(scheduled)`` builds the
    step's flat tensors and ``AttentionMetadata`` once, plans the backend, runs the forward pass with the
    backend passed in explicitly, and samples only the rows whose chunk reaches a request's newest token (and
    verifies the proposals scheduled after it, with speculative decoding)."""

    supports_speculation = True

    model: CausalLM  # what load_model builds (from a GGUF file too); set in __init__

    def __init__(self, context: RunnerContext) -> None:
        """Load the model of ``context.model_dir`` in the engine's dtype on its device (the fast weight
        layouts when ``config.fast_path``); seed the engine's sampling generator."""
        config, hf_config = context.config, context.hf_config
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype)
        self.hf_config = hf_config
        gguf = gguf_source(config.model) if config.quantization == "gguf" else None
        self.model = load_model(hf_config, context.model_dir, self.dtype, self.device, config.fast_path,
                                config.quantization, gguf)
        self.num_layers = hf_config.num_hidden_layers
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = head_dim_of(hf_config)
        self.kv_cache_dtype = config.kv_cache_dtype
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.kv_cache: torch.Tensor | None = None
        self.block_size = 0
        self.backend: AttentionBackend | None = None
        self.decode_graphs: DecodeGraphs | None = None

    def init_kv_cache(self, num_blocks: int, block_size: int, backend: AttentionBackend | None,
                      graphs: GraphSettings | None = None) -> None:
        """Allocate the KV cache (in ``config.kv_cache_dtype``), bind it to ``backend`` and, given ``graphs``,
        capture decode CUDA graphs (their padding rows get one scratch block past the allocator's ``num_blocks``)."""
        assert backend is not None, "the engine builds a backend for every runner that loads a model"
        self.block_size = block_size
        self.kv_cache, views = allocate_kv_cache(
            self.num_layers, num_blocks + (1 if graphs else 0), block_size, self.num_kv_heads, self.head_dim,
            self.dtype, self.device, self.kv_cache_dtype,
        )
        backend.bind_kv_caches(views)
        self.backend = backend
        self.decode_graphs = None if graphs is None else DecodeGraphs(
            self.model, backend, graphs, scratch_block=num_blocks, block_size=block_size,
            hidden_size=self.hf_config.hidden_size, dtype=self.dtype, device=self.device,
        )

    def read_kv(self, block_ids: list[int]) -> torch.Tensor:
        """The K/V of ``block_ids``: a [layers, 2, len(block_ids), block_size, kv_heads, head_dim] copy (an 8-bit
        cache's rows are head_dim + 4 wide and carry their scales: ``nanovllm.attention.kv_quant``)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return self._cache().index_select(2, index)

    def write_kv(self, block_ids: list[int], data: torch.Tensor, first_block: int) -> None:
        """Blocks ``first_block:`` of ``data`` into ``block_ids`` of the cache."""
        if not block_ids:
            return
        cache = self._cache()
        cache_dtype = cache.dtype  # an 8-bit cache's packed rows stay bytes
        src = data[:, :, first_block:first_block + len(block_ids)].to(self.device, cache_dtype)
        # Per run of consecutive pool blocks (a load's fresh blocks are often side by side), each (layer, K/V)
        # slab is copied straight from ``data``, which may be a view of a tier's storage: an index_copy_ or a
        # gather first would go through a temporary, copying every byte twice. On CPU the C++ kernel copies
        # every slab of every run in one call with streaming stores (whole lines written without reading them
        # first); without it, numpy per run (faster than torch's copy_ on these strided slabs, and a run counting
        # down is one copy too: a negative stride, which torch has not). Both copy bytes: bit for bit.
        if cache.device.type == "cpu":
            compiled = _copy_kernels()
            if compiled is not None and kernel_copy_fits(cache, src):
                copy_runs_kernel(compiled, cache, src, block_ids)
                return
            if cache.element_size() in _SAME_WIDTH_INT:
                copy_runs_numpy(cache, src, block_ids)
                return
        for j, low, n, _ in _consecutive_runs(block_ids, descending=False):
            cache[:, :, low:low + n].copy_(src[:, :, j:j + n])

    def check_kv(self, data: object, num_blocks: int) -> str | None:
        if not isinstance(data, torch.Tensor):
            return f"kv transfer: expected a tensor of K/V, got {type(data).__name__}"
        cache = self._cache()
        expected = (cache.shape[0], 2, num_blocks, *cache.shape[3:])
        cache_dtype = cache.dtype
        if tuple(data.shape) != expected or data.dtype != cache_dtype:
            return (f"kv transfer: K/V of shape {tuple(data.shape)} and dtype {data.dtype} do not fit this "
                    f"replica's cache (expected {expected}, {cache_dtype}): another model, dtype, "
                    "kv_cache_dtype or block size")
        return None

    def _cache(self) -> torch.Tensor:
        assert self.kv_cache is not None, "the KV cache is allocated by init_kv_cache"
        return self.kv_cache

    def _prepare(
        self, scheduled: list[tuple[Request, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], torch.Tensor, list[list[int]]]:
        """Flat tensors for the step, and which scheduled requests sample (their chunk reaches the newest
        token) with the flat rows whose logits they need: the row of their newest token, then one row per
        proposed token scheduled after it (speculative decoding: the proposals are fed as the chunk's tail)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        samplers: list[int] = []
        proposals: list[list[int]] = []
        sample_rows: list[int] = []
        bs = self.block_size
        for i, (request, num_new) in enumerate(scheduled):
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            table = request.block_table
            drafted = num_proposed(request, num_new)
            tokens = request.token_ids + request.spec_token_ids[:drafted] if drafted else request.token_ids
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            if end >= request.num_tokens:
                samplers.append(i)
                proposals.append(request.spec_token_ids[:drafted])
                sample_rows.extend(range(len(input_ids) - 1 - drafted, len(input_ids)))

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, device=self.device, dtype=torch.long)

        meta = AttentionMetadata(
            query_lens=query_lens, seq_lens=seq_lens, block_tables=[r.block_table for r, _ in scheduled],
            slot_mapping=longs(slots), block_size=bs,
        )
        return longs(input_ids), longs(positions), meta, samplers, longs(sample_rows), proposals

    @torch.inference_mode()
    def execute(
        self, scheduled: list[tuple[Request, int]]
    ) -> tuple[list[int | None], list[dict[int, Logprob] | None]]:
        """Run one step. Returns, per scheduled request, its next token (None for a partial prefill chunk) and
        that token's top logprobs (None unless its request asked for ``logprobs``); for a request whose
        proposals were verified (speculative decoding), the list of tokens it emits and a list of their
        logprobs."""
        input_ids, positions, meta, samplers, sample_rows, proposals = self._prepare(scheduled)
        if self.decode_graphs is not None and self.decode_graphs.can_run(meta):
            hidden = self.decode_graphs.run(input_ids, positions, meta)
        else:
            assert self.backend is not None, "execute runs after init_kv_cache, which binds the backend"
            self.backend.plan(meta)
            hidden = self.model(input_ids, positions, self.backend)
        next_tokens: list = [None] * len(scheduled)
        next_logprobs: list = [None] * len(scheduled)
        if samplers:
            logits = self.model.compute_logits(hidden.index_select(0, sample_rows))
            # Each sampler's rows in ``logits``: its newest token's, then one per proposal.
            first_row = [0]
            for drafts in proposals:
                first_row.append(first_row[-1] + 1 + len(drafts))
            plain = [j for j, drafts in enumerate(proposals) if not drafts]
            if plain:
                requests = [scheduled[samplers[j]][0] for j in plain]
                params = [r.sampling_params for r in requests]
                rows = logits if len(plain) == len(samplers) else logits.index_select(
                    0, torch.tensor([first_row[j] for j in plain], device=logits.device))
                tokens = self.sampler(rows, params, [r.generator or self.generator for r in requests])
                logprobs = top_logprobs(rows, tokens, [p.logprobs for p in params])
                for j, token, lp in zip(plain, tokens, logprobs):
                    next_tokens[samplers[j]], next_logprobs[samplers[j]] = token, lp
            for j, drafts in enumerate(proposals):
                if not drafts:
                    continue
                # A verified request gets a list: the accepted proposals and the target's own next token.
                request = scheduled[samplers[j]][0]
                rows = logits[first_row[j]:first_row[j + 1]]
                tokens = verify_proposals(rows, drafts, request.sampling_params, request.generator or self.generator)
                next_tokens[samplers[j]] = tokens
                next_logprobs[samplers[j]] = emitted_logprobs(rows, tokens, request.sampling_params.logprobs)
        return next_tokens, next_logprobs
