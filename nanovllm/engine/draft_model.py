"""A model that proposes tokens for speculative decoding (the ``draft`` and ``layer_skip`` proposers), with a
paged KV cache of its own.

Why its own cache, and not recomputing the context each step: a request's context grows to hundreds or
thousands of tokens, and re-reading it through even a small model every step costs as much as a prefill per
step. Why not the target's cache: the draft is another model (other layers, other K/V), and the target's
allocator sizes its pool for the target alone. So each request keeps, here, the token ids whose K/V this cache
holds; at each proposal the longest common prefix of those ids and the request's current tokens is what stays
valid (the K/V of a position depends only on the tokens up to it), everything past it is rolled back (the
proposals the target rejected, or all of a request the target preempted and recomputed: its tokens are the same,
so nothing is lost), and only the tokens past it are fed. In the usual step that is the accepted proposals the
draft had not fed yet plus the target's own token: one small chunk, then K-1 single-token decodes, every request
of the step batched into each forward.

Blocks come from a free list over one cache tensor that doubles when it runs out (rare: the pool follows the
running requests' lengths, and a finished request's blocks come back at once).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from nanovllm.attention.base import ATTENTION_BACKENDS, AttentionBackend, AttentionMetadata, resolve_attention
from nanovllm.config import head_dim_of, max_positions_of, torch_dtype
from nanovllm.engine.kv_cache import allocate_kv_cache
from nanovllm.models.base import CausalLM
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.loader import default_gguf_path, load_model, resolve_model
from nanovllm.request import Request


@dataclasses.dataclass
class _Cached:
    """One request's state in the draft's cache: the token ids whose K/V it holds (positions 0..len-1) and the
    blocks holding them (and room for the next ones)."""

    tokens: list[int]
    blocks: list[int]


class DraftModel:
    """A causal LM proposing greedily over its own paged KV cache (module docstring: why, and how rejected
    proposals roll back). Built by a proposer when the engine builds it; ``propose`` is called once per engine
    step with the requests that speculate, ``forget`` when one ends."""

    def __init__(self, model: CausalLM, hf_config: Any, dtype: torch.dtype, device: torch.device,
                 attention: Any = "auto", block_size: int = 16, initial_blocks: int = 64) -> None:
        self.model = model
        self.dtype, self.device = dtype, device
        self.block_size = block_size
        self.vocab_size: int = hf_config.vocab_size
        self.max_positions = max_positions_of(hf_config)
        self.num_layers = len(model.layers) if isinstance(model, LlamaForCausalLM) else hf_config.num_hidden_layers
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = head_dim_of(hf_config)
        self.backend: AttentionBackend = ATTENTION_BACKENDS.build(
            resolve_attention(attention, device), hf_config.num_attention_heads, self.num_kv_heads,
            self.head_dim, self.head_dim ** -0.5)
        self.cache = torch.empty(0)
        self.free: list[int] = []
        self._grow(initial_blocks)
        self.requests: dict[str, _Cached] = {}
        self.num_forwards = 0     # forward passes run (tests and benchmarks read these)
        self.num_fed_tokens = 0   # tokens fed through them

    @classmethod
    def load(cls, model: str | Path | None, quantization: str | None, target_config: Any, dtype: str,
             device: str, attention: Any = "auto") -> "DraftModel":
        """A separate draft model: a local HF directory or a ``.gguf`` file (None: the default model's GGUF);
        ``quantization='gguf'`` runs the file's own 4-bit blocks (on CPU), None its dense weights in ``dtype``.
        It must share the target's tokenizer (its ids are the target's): a different vocabulary size is refused."""
        from transformers import AutoConfig

        gguf = (default_gguf_path() if model is None or str(model) == "" else Path(model).expanduser()
                if quantization == "gguf" else None)
        if gguf is not None and gguf.suffix != ".gguf":
            raise ValueError(f"speculative.quantization='gguf' runs a .gguf file's blocks; {str(model)!r} is not one")
        model_dir = resolve_model(model, weights=quantization != "gguf")
        hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
        if target_config is not None and hf_config.vocab_size != target_config.vocab_size:
            raise ValueError(f"speculative.model={str(model)!r} has a vocabulary of {hf_config.vocab_size} tokens, the "
                             f"target {target_config.vocab_size}: a draft model must share the target's tokenizer")
        run_on = torch.device("cpu") if quantization == "gguf" else torch.device(device)
        loaded = load_model(hf_config, model_dir, torch_dtype(dtype), run_on, fast_path=quantization is not None,
                            quantization=quantization, gguf=gguf)
        return cls(loaded, hf_config, torch_dtype(dtype), run_on, attention)

    @classmethod
    def first_layers(cls, target: CausalLM, hf_config: Any, num_layers: int, dtype: torch.dtype,
                     device: torch.device, attention: Any = "auto") -> "DraftModel":
        """Self-speculation: the target's first ``num_layers`` decoder layers, then its final norm and LM head,
        sharing the target's weights (nothing is copied). The target model itself is left untouched."""
        if not isinstance(target, LlamaForCausalLM):
            raise ValueError(f"layer_skip needs a Llama-family target (LlamaForCausalLM), got {type(target).__name__}")
        total = len(target.layers)
        if not 1 <= num_layers < total:
            raise ValueError(f"speculative.num_layers must be in [1, {total - 1}] for this {total}-layer model, "
                             f"got {num_layers}")
        # A shallow copy with its own module table, so that replacing ``layers`` leaves the target's alone (the
        # loader may share the target between engines); its C++ decoder stack is built for its own layer list.
        early = copy.copy(target)
        early._modules = dict(target._modules)
        early.layers = nn.ModuleList(list(target.layers)[:num_layers])
        early._decoder_stack = None
        return cls(early, hf_config, dtype, device, attention)

    # -- the pool -------------------------------------------------------------------------------------------

    def _grow(self, num_blocks: int) -> None:
        """Add ``num_blocks`` blocks to the pool: a larger cache tensor, the old blocks copied into it, the
        backend bound to the new views."""
        old = self.cache
        old_blocks = old.shape[2] if old.dim() == 6 else 0
        cache, views = allocate_kv_cache(self.num_layers, old_blocks + num_blocks, self.block_size,
                                         self.num_kv_heads, self.head_dim, self.dtype, self.device)
        if old_blocks:
            cache[:, :, :old_blocks].copy_(old)
        self.cache = cache
        self.backend.bind_kv_caches(views)
        self.free.extend(range(old_blocks + num_blocks - 1, old_blocks - 1, -1))

    def _reserve(self, state: _Cached, num_positions: int) -> None:
        """Blocks in ``state`` for positions 0..num_positions-1."""
        needed = -(-num_positions // self.block_size) - len(state.blocks)
        if needed > len(self.free):
            self._grow(max(needed - len(self.free), self.cache.shape[2]))
        for _ in range(needed):
            state.blocks.append(self.free.pop())

    def _trim(self, state: _Cached, length: int) -> None:
        """Roll ``state`` back to its first ``length`` tokens; blocks past them go back to the pool."""
        del state.tokens[length:]
        keep = -(-length // self.block_size)
        self.free.extend(reversed(state.blocks[keep:]))
        del state.blocks[keep:]

    # -- what the proposers call ----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        """Per request, ``num_tokens[i]`` tokens the draft's greedy decoding continues ``token_ids`` with (fewer
        only where the draft's positions run out). One forward feeds each request's tokens not yet in the cache
        (rolled back to the common prefix first), then one forward per further token."""
        proposals: list[list[int]] = [[] for _ in requests]
        feeds: list[list[int]] = []
        states: list[_Cached] = []
        for request, k in zip(requests, num_tokens):
            state = self.requests.setdefault(request.request_id, _Cached([], []))
            tokens = request.token_ids
            common = 0
            for a, b in zip(state.tokens, tokens):
                if a != b:
                    break
                common += 1
            # The newest token is always fed: its logits propose the first token.
            self._trim(state, min(common, len(tokens) - 1))
            states.append(state)
            feeds.append(list(tokens[len(state.tokens):]))
        active = [i for i, k in enumerate(num_tokens)
                  if k > 0 and len(requests[i].token_ids) + k - 1 <= self.max_positions]
        while active:
            next_ids = self._forward([states[i] for i in active], [feeds[i] for i in active])
            still = []
            for i, token in zip(active, next_ids):
                proposals[i].append(token)
                feeds[i] = [token]
                if len(proposals[i]) < num_tokens[i]:
                    still.append(i)
            active = still
        return proposals

    def _forward(self, states: list[_Cached], feeds: list[list[int]]) -> list[int]:
        """Feed each state its ``feeds`` tokens (appended to its cache) and return each one's greedy next token."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        for state, feed in zip(states, feeds):
            start = len(state.tokens)
            self._reserve(state, start + len(feed))
            input_ids.extend(feed)
            positions.extend(range(start, start + len(feed)))
            slots.extend(state.blocks[p // bs] * bs + p % bs for p in range(start, start + len(feed)))
            last_rows.append(len(input_ids) - 1)
        meta = AttentionMetadata(
            query_lens=[len(f) for f in feeds], seq_lens=[len(s.tokens) + len(f) for s, f in zip(states, feeds)],
            block_tables=[s.blocks for s in states], slot_mapping=self._longs(slots), block_size=bs)
        self.backend.plan(meta)
        hidden = self.model(self._longs(input_ids), self._longs(positions), self.backend)
        logits = self.model.compute_logits(hidden.index_select(0, self._longs(last_rows)))
        self.num_forwards += 1
        self.num_fed_tokens += len(input_ids)
        for state, feed in zip(states, feeds):
            state.tokens.extend(feed)
        return logits.float().argmax(dim=-1).tolist()

    def _longs(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def forget(self, request: Request) -> None:
        """``request`` ended: its blocks go back to the pool."""
        state = self.requests.pop(request.request_id, None)
        if state is not None:
            self._trim(state, 0)

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose K/V the draft holds now, over every request."""
        return sum(len(s.tokens) for s in self.requests.values())
