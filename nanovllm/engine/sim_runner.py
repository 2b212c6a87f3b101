"""The simulated runner (``runner=sim``): the engine's runner seam without a model. It loads no weights and
computes nothing; each step it asks a step-time model how long the batch would take, advances its virtual
clock (the engine's clock) by that much, and hands back deterministic stand-in tokens. The scheduler, the policy and the allocator around it are the real
ones, unchanged, so a simulated run makes the decisions a real run would make given the same step times.

Output lengths: a request stops when it reaches its target length (``target_len(request)``, by default its
``max_tokens``), as if it produced EOS there. Stand-in tokens are never EOS before that, and the prompt tokens
are the real ones, so prefix caching sees what it would see in a real run.

The step-time model is any callable from a batch's features (``batch_features``: the keys of a ``StepRecord``)
and the step's start time to seconds; the harness (``nanovllm.harness.sim``) provides calibrated, analytical,
replay and token-cost models (``StepTimeModel.predict``).

KV tiers (``kv_offload``): the engine runs the same tier and offload-policy classes payload-free, and this
runner charges each step the time of the K/V that moved between the pool and each tier since the last step,
on that tier's link (``kv_links``: ``hardware.kv_tier_links``, host over PCIe, disk over NVMe, the shared
store over RDMA/Ethernet): ``latency + bytes / bandwidth`` per tier that moved anything, added to the step's
compute time. The real engine copies blocks synchronously inside the step (admission loads, swap-ins and
-outs, write-through, prefetch promotions), before or after the forward pass, never during it; the simulated
step does the same, so no move overlaps compute here either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from nanovllm.config import EngineConfig, head_dim_of, torch_dtype
from nanovllm.engine.engine import LLMEngine, PluginSpec, batch_features
from nanovllm.engine.runner import Runner, RunnerContext, register_runner
from nanovllm.models.loader import resolve_model
from nanovllm.request import Request

if TYPE_CHECKING:
    from nanovllm.engine.kv_offload import KVOffload
    from nanovllm.outputs import Logprob

StepTimeFn = Callable[[Mapping[str, int], float], float]   # (batch features, step start) -> seconds


class VirtualClock:
    """Simulated seconds: time moves only when a step runs (``advance``) or the loop idles (``wait_until``)."""

    def __init__(self, start: float = 0.0) -> None:
        self.time = start

    def __call__(self) -> float:
        return self.time

    def now(self) -> float:
        return self.time

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"a step cannot take {seconds!r} seconds (the step-time model must give >= 0)")
        self.time += seconds

    def wait_until(self, t: float, stop: Any = None) -> None:
        """Idle until ``t`` (nothing sleeps: the clock jumps; ``stop`` is checked by the loop itself)."""
        self.time = max(self.time, t)


@register_runner("sim")
class SimulatedRunner(Runner):
    """Stands in for ``ModelRunner``: same attributes the engine reads, no weights, no KV tensor; its clock is
    virtual (``VirtualClock``) and is the engine's."""

    loads_model = False
    clock: VirtualClock  # a VirtualClock of its own, set in __init__

    def __init__(self, context: RunnerContext, step_time: StepTimeFn,
                 target_len: Callable[[Request], int] | None = None,
                 kv_links: Mapping[str, Mapping[str, float]] | None = None, fast_forward: bool = False) -> None:
        """``step_time(features, now)``: the seconds a step with these batch features, starting at ``now``,
        takes. ``target_len(request)``: the output length at which the request ends (default ``max_tokens``).
        ``kv_links``: tier name -> ``{bandwidth, latency}`` (``hardware.kv_tier_links``); None: moves between
        KV tiers take no simulated time. ``fast_forward``: the engine may compute runs of pure-decode steps at
        once (``nanovllm.engine.decode_stretch``); only for a ``step_time`` that is a pure function of its
        arguments (a replayed timeline is not: each call takes the next recorded step)."""
        hf_config, config = context.hf_config, context.config
        self.hf_config = hf_config
        self.dtype = torch_dtype(config.dtype)
        self.device = torch.device(config.device)
        self.num_layers = hf_config.num_hidden_layers
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(hf_config)
        self.vocab_size = hf_config.vocab_size
        self.step_time = step_time
        self.fast_forward = fast_forward
        self.clock = VirtualClock()
        self.target_len = target_len or (lambda request: request.max_tokens)
        self.num_blocks = 0
        self.block_size = 0
        self.kv_links = {name: dict(link) for name, link in (kv_links or {}).items()}
        self.offload: KVOffload | None = None
        self._moved_seen: dict[str, tuple[float, float]] = {}   # tier -> (bytes loaded, bytes written) charged

    def init_kv_cache(self, num_blocks: int, block_size: int, backend: Any, graphs: Any = None) -> None:
        """Only the geometry: the allocator manages block ids; there is no tensor to fill."""
        self.num_blocks, self.block_size = num_blocks, block_size

    def read_kv(self, block_ids: list[int]) -> None:
        """No K/V to read: a simulated hand-off moves only a byte count (``KVHandoff.num_bytes``)."""
        return None

    def write_kv(self, block_ids: list[int], data: Any, first_block: int) -> None:
        """Nothing to write (the allocator's block ids are the simulated cache)."""

    def bind_kv_offload(self, offload: KVOffload) -> None:
        """Charge the moves of ``offload``'s tiers to the steps; every tier needs a link when any is given."""
        missing = sorted({tier.name for tier in offload.tiers} - set(self.kv_links))
        if self.kv_links and missing:
            raise ValueError(f"hardware.kv_tier_links has no link for KV tier(s) {', '.join(missing)} (has: "
                             f"{', '.join(sorted(self.kv_links))}); add {{bandwidth, latency}} for each")
        self.offload = offload

    def tier_seconds(self) -> float:
        """Simulated seconds of what moved between the pool and the tiers since the last call, each tier on its
        link; each tier's share of reading blocks out is added to its ``load_seconds``."""
        offload = self.offload
        if offload is None or not self.kv_links:
            return 0.0
        total = 0.0
        for name, tier in zip(offload.names, offload.tiers):
            stats = offload.stats[name]
            seen_loaded, seen_written = self._moved_seen.get(name, (0, 0))
            loaded, written = stats.bytes_loaded - seen_loaded, stats.bytes_written - seen_written
            self._moved_seen[name] = (stats.bytes_loaded, stats.bytes_written)
            if loaded + written == 0:
                continue
            link = self.kv_links[tier.name]
            # One latency per tier and step: the step's blocks for one tier go as one batched transfer.
            seconds = link["latency"] + (loaded + written) / link["bandwidth"]
            stats.load_seconds += seconds * loaded / (loaded + written)
            total += seconds
        return total

    def execute(
        self, scheduled: list[tuple[Request, int]]
    ) -> tuple[list[int | None], list[dict[int, Logprob] | None]]:
        """Advance the clock by the predicted step time (plus the KV tiers' moves: ``tier_seconds``); a
        stand-in token for every row that samples (and no logprobs: there is no distribution to report), as
        ``ModelRunner.execute`` returns them."""
        compute = float(self.step_time(batch_features(scheduled), self.clock.time))
        self.clock.advance(compute + self.tier_seconds())
        tokens = [self._token(request) if request.num_computed_tokens + n == request.num_tokens else None
                  for request, n in scheduled]
        return tokens, [None] * len(tokens)

    def stand_in_tokens(self, request: Request, count: int) -> list[int]:
        """The next ``count`` stand-in tokens ``execute`` would give ``request`` step after step, none of them
        its last (a decode stretch ends before a request's finishing step)."""
        tokens: list[int] = []
        last, length, vocab, eos = request.token_ids[-1], request.num_tokens, self.vocab_size, request.eos_token_ids
        for _ in range(count):
            token = (last * 31 + length) % vocab
            while token in eos:
                token = (token + 1) % vocab
            tokens.append(token)
            last, length = token, length + 1
        return tokens

    def _token(self, request: Request) -> int:
        # The token about to be appended is output number num_output_tokens + 1. A target below max_tokens
        # ends with EOS ("stop"); at max_tokens the request ends by length, as a real one would.
        target = self.target_len(request)
        if (request.num_output_tokens + 1 >= target and target < request.max_tokens and request.eos_token_ids
                and not request.sampling_params.ignore_eos):
            return min(request.eos_token_ids)
        token = (request.token_ids[-1] * 31 + request.num_tokens) % self.vocab_size
        while token in request.eos_token_ids:
            token = (token + 1) % self.vocab_size
        return token


def simulated_engine(config: EngineConfig, step_time: StepTimeFn, *, scheduler: PluginSpec = "fcfs",
                     allocator: PluginSpec = "paged", attention: PluginSpec = "torch",
                     target_len: Callable[[Request], int] | None = None, tokenizer: Any = None,
                     hf_config: Any = None, kv_links: Mapping[str, Mapping[str, float]] | None = None,
                     fast_forward: bool = False) -> LLMEngine:
    """An ``LLMEngine`` with the real scheduler, policy and allocator on a ``SimulatedRunner`` (its virtual
    clock is ``engine.clock``). Loads the model's config and tokenizer only; KV blocks come from
    ``num_kv_blocks`` or ``kv_cache_memory`` (or ``kv_cache_fraction`` of this machine's free memory). A model
    directory holding only a ``config.json`` (an architecture to simulate, no weights) is tokenized with the
    default model's tokenizer. ``tokenizer``, ``hf_config``: use these instead of loading them (replicas of a
    simulated cluster share them). ``kv_links``: the KV tiers' links (``hardware.kv_tier_links``).
    ``fast_forward``: decode stretches (``SimulatedRunner``)."""
    from transformers import AutoTokenizer

    if tokenizer is None:
        model_dir = resolve_model(config.model)
        has_tokenizer = any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                                     "tokenizer.model"))
        # None: LLMEngine loads the model directory's own.
        tokenizer = None if has_tokenizer else AutoTokenizer.from_pretrained(resolve_model(None))
    runner = {"name": "sim", "step_time": step_time, "target_len": target_len, "kv_links": kv_links,
              "fast_forward": fast_forward}
    return LLMEngine(config, scheduler=scheduler, allocator=allocator, attention=attention, runner=runner,
                     tokenizer=tokenizer, hf_config=hf_config)
