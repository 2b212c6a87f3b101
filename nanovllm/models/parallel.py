"""Tensor-parallel layers for the Llama family, and the function that turns a loaded model into one rank's shard.

Megatron-style, as vLLM and upstream nano-vllm split it: q/k/v and gate/up are column-parallel (each rank keeps
a slice of the output features, no communication), o_proj and down_proj are row-parallel (each rank multiplies
its slice of the input features, then one all-reduce sums the partial products), the embedding is
vocabulary-parallel (each rank looks up the ids in its vocabulary range, one all-reduce fills the rest) and so is
the LM head (each rank computes the logits of its vocabulary range, one all-gather joins them). Two all-reduces
per decoder layer.

Attention is split by KV-head group, so the KV cache is sharded by KV head and GQA groups never straddle ranks:
the KV heads are dealt out as evenly as possible (SmolLM2-135M's 3 KV heads over 2 ranks: 2 and 1) and each rank
keeps the query heads of its groups. So ``tensor_parallel_size`` may be any size up to the number of KV heads;
uneven shards are fine because only the [tokens, hidden] sums and the padded logits cross ranks.

Arithmetic: the column-parallel parts compute the same dot products (a narrower matmul may block them
differently), the vocabulary-parallel embedding is exact, and the row-parallel all-reduce adds partial sums
where the full matmul adds one long one; so float results may differ in the last bits (see docs/scaling.md's
tensor-parallel section for the standard this meets).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.models.base import CausalLM


class Collectives(Protocol):
    """What the layers need from their process group (``nanovllm.engine.tp.comm.Communicator``)."""

    def all_reduce(self, tensor: torch.Tensor) -> None: ...

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor) -> None: ...


class DenseLinear(Protocol):
    """A linear holding a plain weight matrix [out, in] and an optional bias (``nn.Linear``), which the
    parallel layers slice."""

    weight: torch.Tensor
    bias: torch.Tensor | None


class ShardableModel(Protocol):
    """What ``shard_model`` reads of a Llama-family model (``LlamaForCausalLM``)."""

    config: Any
    layers: nn.ModuleList
    embed_tokens: nn.Embedding
    lm_head: nn.Linear


class ShardableAttention(Protocol):
    """The head counts and sizes ``shard_model`` reads and rewrites on a layer's ``self_attn`` (``llama.Attention``)."""

    head_dim: int
    num_heads: int
    num_kv_heads: int
    q_size: int
    kv_size: int


class FusedMLP(Protocol):
    """An MLP whose fused forward splits gate from up by ``intermediate_size`` (``llama.MLP``)."""

    intermediate_size: int


@dataclass(frozen=True)
class HeadShard:
    """The heads one rank owns: KV heads ``[kv_start, kv_start + num_kv_heads)`` and their query heads."""

    kv_start: int
    num_kv_heads: int
    group: int                  # query heads per KV head

    @property
    def q_start(self) -> int:
        return self.kv_start * self.group

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadShard:
    """Rank ``rank``'s heads of ``world``: KV heads dealt out as evenly as possible, the first ranks one more."""
    check_tensor_parallel_size(num_heads, num_kv_heads, world)
    base, extra = divmod(num_kv_heads, world)
    start = rank * base + min(rank, extra)
    return HeadShard(start, base + (1 if rank < extra else 0), num_heads // num_kv_heads)


def check_tensor_parallel_size(num_heads: int, num_kv_heads: int, world: int) -> None:
    """Raise ``ValueError`` unless the model's heads can be split over ``world`` ranks."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {world!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads "
                         f"({num_kv_heads}); cannot split attention by KV-head group")
    if world > num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({world}) must be <= the model's num_key_value_heads "
                         f"({num_kv_heads}): the KV cache is sharded by KV head, so every worker needs one")


def _even_split(size: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, end)`` of rank's slice of ``size`` features, as even as possible."""
    base, extra = divmod(size, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class ColumnParallelLinear(nn.Module):
    """Output features ``[start, end)`` of a linear layer (and, for a fused projection, the ranges in ``also``,
    concatenated in order); no communication."""

    def __init__(self, full: DenseLinear, start: int, end: int, also: Sequence[tuple[int, int]] = ()) -> None:
        super().__init__()
        ranges = [(start, end), *also]
        self.weight = nn.Parameter(torch.cat([full.weight.data[a:b] for a, b in ranges]).clone(),
                                   requires_grad=False)
        self.bias = None if full.bias is None else nn.Parameter(
            torch.cat([full.bias.data[a:b] for a, b in ranges]).clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features ``[start, end)`` of a linear layer; the partial products are summed over the ranks, then
    the bias (held by every rank, added once after the sum)."""

    def __init__(self, full: DenseLinear, start: int, end: int, comm: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.data[:, start:end].clone(), requires_grad=False)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.data.clone(), requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        self.comm.all_reduce(out)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, end)`` of the embedding; ids outside the range read zeros, and the all-reduce fills them
    in from the rank that owns them (adding zeros, so the result is exactly the full lookup)."""

    def __init__(self, full: nn.Embedding, start: int, end: int, comm: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.data[start:end].clone(), requires_grad=False)
        self.start, self.end, self.comm = start, end, comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mine, input_ids - self.start, torch.zeros_like(input_ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        self.comm.all_reduce(out)
        return out


class ParallelLMHead(nn.Module):
    """Logits of vocabulary rows ``[start, end)``; ``forward`` all-gathers every rank's (padded to the largest
    shard with -inf, then cut back) into the full [rows, vocab] logits on every rank."""

    def __init__(self, weight: torch.Tensor, start: int, end: int, vocab_size: int, world: int,
                 comm: Collectives) -> None:
        super().__init__()
        self.weight = weight  # shared with the embedding shard when the model ties them
        self.vocab_size, self.world, self.comm = vocab_size, world, comm
        self.shard_rows = -(-vocab_size // world)
        self.start, self.end = start, end

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)
        if local.shape[1] < self.shard_rows:
            pad = local.new_full((local.shape[0], self.shard_rows - local.shape[1]), float("-inf"))
            local = torch.cat([local, pad], dim=1)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        self.comm.all_gather(parts, local.contiguous())
        sizes = [_even_split(self.vocab_size, r, self.world) for r in range(self.world)]
        return torch.cat([p[:, : end - start] for p, (start, end) in zip(parts, sizes)], dim=1)


M = TypeVar("M", bound=nn.Module)


def shard_model(model: CausalLM, rank: int, world: int, comm: Collectives) -> CausalLM:
    """A copy of a loaded ``LlamaForCausalLM`` holding only rank ``rank``'s shard of every weight, whose
    collectives go through ``comm`` (the loaded
    model, which the loader may share between engines, is left untouched). The copy gains ``lm_head_parallel``
    (a :class:`ParallelLMHead`) for the runner's logits."""
    # nn.Module's submodules are dynamic attributes: these are the ones a Llama-family model has.
    full = cast(ShardableModel, model)
    config = full.config
    shard = _shallow(model)  # its submodule dict is replaced below, never the original's
    heads = head_shard(config.num_attention_heads, config.num_key_value_heads, rank, world)
    shard.layers = nn.ModuleList(_shard_layer(layer, heads, rank, world, comm) for layer in full.layers)
    start, end = _even_split(config.vocab_size, rank, world)
    embedding = shard.embed_tokens = VocabParallelEmbedding(full.embed_tokens, start, end, comm)
    tied = full.lm_head.weight is full.embed_tokens.weight
    head_weight = embedding.weight if tied else full.lm_head.weight.data[start:end].clone()
    shard.lm_head_parallel = ParallelLMHead(head_weight, start, end, config.vocab_size, world, comm)
    del shard._modules["lm_head"]
    return shard


def _shard_layer(layer: nn.Module, heads: HeadShard, rank: int, world: int,
                 comm: Collectives) -> nn.Module:
    layer = _shallow(layer)
    attn = layer.self_attn = _shallow(_submodule(layer, "self_attn"))
    sizes = cast(ShardableAttention, attn)  # llama.Attention's fields (nn.Module's attributes are dynamic)
    d = sizes.head_dim
    q = (heads.q_start * d, (heads.q_start + heads.num_heads) * d)
    kv = (heads.kv_start * d, (heads.kv_start + heads.num_kv_heads) * d)
    if _has_weight(attn, "qkv_proj"):  # a fused projection: this rank's q, k and v rows, fused again
        q_size, kv_size = sizes.num_heads * d, sizes.num_kv_heads * d
        attn.qkv_proj = ColumnParallelLinear(_dense(attn, "qkv_proj"), *q,
                                             also=[(q_size + kv[0], q_size + kv[1]),
                                                   (q_size + kv_size + kv[0], q_size + kv_size + kv[1])])
    else:
        _require_weight(attn, "q_proj")
        attn.q_proj = ColumnParallelLinear(_dense(attn, "q_proj"), *q)
        attn.k_proj = ColumnParallelLinear(_dense(attn, "k_proj"), *kv)
        attn.v_proj = ColumnParallelLinear(_dense(attn, "v_proj"), *kv)
    attn.o_proj = RowParallelLinear(_dense(attn, "o_proj"), *q, comm)
    sizes.num_heads, sizes.num_kv_heads = heads.num_heads, heads.num_kv_heads
    sizes.q_size, sizes.kv_size = heads.num_heads * d, heads.num_kv_heads * d
    mlp = layer.mlp = _shallow(_submodule(layer, "mlp"))
    if _has_weight(mlp, "gate_up_proj"):  # fused: this rank's gate rows, then its up rows
        size = _dense(mlp, "down_proj").weight.shape[1]
        inter = _even_split(size, rank, world)
        mlp.gate_up_proj = ColumnParallelLinear(_dense(mlp, "gate_up_proj"), *inter,
                                                also=[(size + inter[0], size + inter[1])])
    else:
        _require_weight(mlp, "gate_proj")
        inter = _even_split(_dense(mlp, "gate_proj").weight.shape[0], rank, world)
        mlp.gate_proj = ColumnParallelLinear(_dense(mlp, "gate_proj"), *inter)
        mlp.up_proj = ColumnParallelLinear(_dense(mlp, "up_proj"), *inter)
    mlp.down_proj = RowParallelLinear(_dense(mlp, "down_proj"), *inter, comm)
    if hasattr(mlp, "intermediate_size"):  # a fused forward splits gate from up by it
        cast(FusedMLP, mlp).intermediate_size = inter[1] - inter[0]
    return layer


def _has_weight(module: nn.Module, name: str) -> bool:
    return isinstance(getattr(getattr(module, name, None), "weight", None), torch.Tensor)


def _require_weight(module: nn.Module, name: str) -> None:
    if not _has_weight(module, name):
        raise ValueError(f"tensor parallelism cannot shard {type(module).__name__}.{name}: it needs a plain "
                         f"weight matrix (prepacked fast-path weights cannot be sliced); use the reference layout")


def _submodule(module: nn.Module, name: str) -> nn.Module:
    """``module.<name>``, a submodule (read through nn.Module's attributes, which are typed Tensor | Module)."""
    child = getattr(module, name)
    assert isinstance(child, nn.Module), f"{type(module).__name__}.{name} is not a module"
    return child


def _dense(module: nn.Module, name: str) -> DenseLinear:
    """``module.<name>``, a linear with a plain weight matrix (what the parallel layers slice)."""
    linear: DenseLinear = getattr(module, name)
    return linear


def _shallow(module: M) -> M:
    """A copy sharing the original's parameters, whose own submodules can be replaced without touching it."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone
