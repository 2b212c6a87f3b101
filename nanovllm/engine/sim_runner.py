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

Speculative decoding (``EngineConfig.speculative``): the engine runs its own ``Speculator``, speculation
policy and scheduler budgets; only the proposer and the verification are stand-ins. ``stand_in_proposer`` gives
the engine a ``SimulatedProposer``, which proposes as many tokens as the ``AcceptanceModel`` says the configured
proposer would (``num_proposed``: an ``ngram`` lookup can find nothing), the stand-in tokens this runner would
emit one at a time; ``execute`` accepts as many of a row's proposals as the model says (``num_accepted``) and
returns them with one token of its own, as ``ModelRunner.execute`` returns a verification. The step's features
carry the proposals (``num_decode_tokens``, ``SPEC_FEATURES``) so the step-time model prices the verify forward
and the proposer's own work (``nanovllm.harness.sim.speculation``).

KV tiers (``kv_offload``): the engine runs the same tier and offload-policy classes payload-free, and this
runner charges each step the time of the K/V that moved between the pool and each tier since the last step,
on that tier's link (``kv_links``: ``hardware.kv_tier_links``, host over PCIe, disk over NVMe, the shared
store over RDMA/Ethernet): ``latency + bytes / bandwidth`` per tier that moved anything, added to the step's
compute time. The real engine copies blocks synchronously inside the step (admission loads, swap-ins and
-outs, write-through, prefetch promotions), before or after the forward pass, never during it; the simulated
step does the same, so no move overlaps compute here either.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from nanovllm.config import EngineConfig, head_dim_of, torch_dtype
from nanovllm.engine.engine import LLMEngine, PluginSpec, batch_features
from nanovllm.engine.runner import Runner, RunnerContext, register_runner
from nanovllm.engine.speculative import num_proposed
from nanovllm.models.loader import resolve_model
from nanovllm.proposer import PROPOSERS, Proposer, ProposerContext
from nanovllm.request import Request

if TYPE_CHECKING:
    from nanovllm.engine.kv_offload import KVOffload
    from nanovllm.outputs import Logprob

StepTimeFn = Callable[[Mapping[str, int], float], float]   # (batch features, step start) -> seconds

# What a simulated step's features add with speculation, under the names of the step record's counters (so a
# profile fitted on real steps.jsonl reads them alike): rows that verified proposals, proposed tokens verified,
# the most proposed for one row (a draft model's forwards that step; a real record's length of
# ``spec_decode_num_accepted_tokens_per_pos``), and the tokens the proposer's own model was fed (draft models).
SPEC_FEATURES = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_max_proposed",
                 "spec_proposer_fed_tokens")


class AcceptanceModel(abc.ABC):
    """How a simulated proposer and verification behave, per request: how many tokens the configured proposer
    proposes when allowed ``num_tokens`` (``num_proposed``), and how many of ``num_proposed`` proposals the
    target accepts (``num_accepted``, a prefix: 0..num_proposed). The harness's models (``runner.acceptance``:
    a fixed rate, fitted to a real run's records, or replayed from them) live in
    ``nanovllm.harness.sim.speculation``. Called by the simulated proposer and runner during each step;
    ``on_finish`` when a request ends."""

    def num_proposed(self, request: Request, num_tokens: int) -> int:
        """Tokens proposed for ``request`` when up to ``num_tokens`` (>= 1) may be; the base: all of them."""
        return num_tokens

    @abc.abstractmethod
    def num_accepted(self, request: Request, num_proposed: int) -> int:
        """Of ``num_proposed`` (>= 1) proposals verified for ``request``, how many the target accepts."""

    def on_finish(self, request: Request) -> None:
        """``request`` ended; forget whatever was kept for it."""

    def describe(self) -> str:
        """What the run's ``metrics.json`` says under ``acceptance_model``."""
        return type(self).__name__


class SimulatedProposer(Proposer):
    """The configured proposer's stand-in in a simulated run: proposes the tokens the simulated runner would emit
    next, as many as the acceptance model says the real proposer would; its ``registered_name`` is the configured
    method's, so errors and records name it."""

    def __init__(self, context: ProposerContext, runner: "SimulatedRunner", acceptance: AcceptanceModel) -> None:
        super().__init__(context)
        assert context.config.speculative is not None
        self.registered_name = str(context.config.speculative["method"])
        self.runner, self.acceptance = runner, acceptance
        # The configured proposer's model, if it runs one, is fed as the real one is (``num_fed_tokens``).
        self.feeds_a_model = PROPOSERS.get(self.registered_name).feeds_a_model
        self._fed = 0
        self._drafted_through: dict[str, int] = {}   # request -> tokens its draft cache holds after proposing

    @property
    def num_fed_tokens(self) -> int:
        return self._fed

    def propose_one(self, request: Request, num_tokens: int) -> list[int]:
        count = self.acceptance.num_proposed(request, num_tokens)
        if not isinstance(count, int) or not 0 <= count <= num_tokens:
            raise ValueError(f"acceptance model {self.acceptance.describe()}: num_proposed must be in "
                             f"[0, {num_tokens}], got {count!r}")
        if count and self.feeds_a_model:
            self._feed(request, count)
        return self.runner.stand_in_tokens(request, count)

    def _feed(self, request: Request, count: int) -> None:
        """Count what the real draft model feeds to propose ``count`` tokens (``DraftModel.propose``): the
        request's tokens its cache lacks (all of them the first time; the newest token always), then its own
        first ``count - 1`` proposals. After the verification its cache holds the tokens it had fed up to the
        first rejected proposal: ``min(tokens now - 1, what it held after proposing)``."""
        n = request.num_tokens
        synced = min(n - 1, self._drafted_through.get(request.request_id, 0))
        self._fed += (n - synced) + (count - 1)
        self._drafted_through[request.request_id] = n + count - 1

    def on_finish(self, request: Request) -> None:
        self._drafted_through.pop(request.request_id, None)
        self.acceptance.on_finish(request)


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
    supports_speculation = True   # verification is simulated by the acceptance model (``acceptance``)
    clock: VirtualClock  # a VirtualClock of its own, set in __init__

    def __init__(self, context: RunnerContext, step_time: StepTimeFn,
                 target_len: Callable[[Request], int] | None = None,
                 kv_links: Mapping[str, Mapping[str, float]] | None = None,
                 acceptance: AcceptanceModel | None = None, fast_forward: bool = False) -> None:
        """``step_time(features, now)``: the seconds a step with these batch features, starting at ``now``,
        takes. ``target_len(request)``: the output length at which the request ends (default ``max_tokens``).
        ``kv_links``: tier name -> ``{bandwidth, latency}`` (``hardware.kv_tier_links``); None: moves between
        KV tiers take no simulated time. ``acceptance``: how proposals are made and accepted (needed with
        ``speculative``). ``fast_forward``: the engine may compute runs of pure-decode steps at once
        (``nanovllm.engine.decode_stretch``); only for a ``step_time`` that is a pure function of its arguments
        (a replayed timeline is not: each call takes the next recorded step)."""
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
        if acceptance is None and context.config.speculative is not None:
            raise ValueError("runner.acceptance: simulating speculative decoding needs an acceptance model: "
                             "runner.acceptance=fitted or replay (with runner.acceptance_run=RUN_DIR, a real run "
                             "with the same proposer), or a per-token acceptance rate in [0, 1]")
        self.acceptance = acceptance
        self._moved_seen: dict[str, tuple[float, float]] = {}   # tier -> (bytes loaded, bytes written) charged
        self._stand_in: SimulatedProposer | None = None
        self._fed_priced = 0   # the stand-in's fed tokens already priced

    def stand_in_proposer(self, context: ProposerContext) -> Proposer | None:
        """The ``SimulatedProposer`` of the acceptance model: no draft model loads."""
        assert self.acceptance is not None   # checked in __init__ when speculation is on
        self._stand_in = SimulatedProposer(context, self, self.acceptance)
        return self._stand_in

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
                             f"{', '.join(sorted(self.kv_links))}); add {{bandwidth, latency}} for each, or, "
                             "for links a calibrated profile measured, calibrate on runs that use these tiers")
        self.offload = offload

    def tier_seconds(self) -> float:
        """Simulated seconds of what moved between the pool and the tiers since the last call, each tier on its
        link; each tier's share of reading blocks out is added to its ``load_seconds``, of writing them in to its
        ``write_seconds``."""
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
            stats.write_seconds += seconds * written / (loaded + written)
            total += seconds
        return total

    def execute(
        self, scheduled: list[tuple[Request, int]]
    ) -> tuple[list[int | None], list[dict[int, Logprob] | None]]:
        """Advance the clock by the predicted step time (plus the KV tiers' moves: ``tier_seconds``); a
        stand-in token for every row that samples, or for a row that verified proposals the accepted ones and a
        token of its own (and no logprobs: there is no distribution to report), as ``ModelRunner.execute``
        returns them."""
        features = batch_features(scheduled)
        drafted = [num_proposed(request, n) for request, n in scheduled]
        if self.acceptance is not None:
            features["spec_decode_num_drafts"] = sum(k > 0 for k in drafted)
            features["spec_decode_num_draft_tokens"] = sum(drafted)
            features["spec_decode_max_proposed"] = max(drafted, default=0)
            if self._stand_in is not None and self._stand_in.feeds_a_model:
                fed = self._stand_in.num_fed_tokens
                features["spec_proposer_fed_tokens"], self._fed_priced = fed - self._fed_priced, fed
        compute = float(self.step_time(features, self.clock.time))
        self.clock.advance(compute + self.tier_seconds())
        tokens: list = []
        for (request, n), k in zip(scheduled, drafted):
            if request.num_computed_tokens + n < request.num_tokens:
                tokens.append(None)
            elif k:
                tokens.append(self._verify(request, k))
            else:
                tokens.append(self._token(request))
        return tokens, [None] * len(tokens)

    def _verify(self, request: Request, k: int) -> list[int]:
        """The tokens verifying ``request``'s first ``k`` proposals emits: the accepted ones, then the runner's
        own next token (EOS where the request reaches its target length)."""
        assert self.acceptance is not None
        accepted = self.acceptance.num_accepted(request, k)
        if not isinstance(accepted, int) or not 0 <= accepted <= k:
            raise ValueError(f"acceptance model {self.acceptance.describe()}: num_accepted must be in [0, {k}], "
                             f"got {accepted!r}")
        target = self.target_len(request)
        if target < request.max_tokens:   # the run ends at its target: no accepted token passes it
            accepted = max(0, min(accepted, target - request.num_output_tokens - 1))
        emitted = request.spec_token_ids[:accepted]
        last = emitted[-1] if emitted else request.token_ids[-1]
        return emitted + [self._token(request, last, accepted)]

    def stand_in_tokens(self, request: Request, count: int) -> list[int]:
        """The ``count`` tokens this runner would emit next for ``request``, one step at a time (what the
        simulated proposer proposes, so an accepted run is the output decoding one at a time gives)."""
        tokens: list[int] = []
        last, length, vocab_size, eos_token_ids = request.token_ids[-1], request.num_tokens, self.vocab_size, \
            request.eos_token_ids
        for j in range(count):   # ``_next`` inlined: a long simulation computes millions of these
            last = (last * 31 + length + j) % vocab_size
            while last in eos_token_ids:
                last = (last + 1) % vocab_size
            tokens.append(last)
        return tokens

    def _token(self, request: Request, last: int | None = None, ahead: int = 0) -> int:
        # The token about to be appended is output number num_output_tokens + ahead + 1 (``ahead``: accepted
        # proposals appended before it). A target below max_tokens ends with EOS ("stop"); at max_tokens the
        # request ends by length, as a real one would.
        target = self.target_len(request)
        if (request.num_output_tokens + ahead + 1 >= target and target < request.max_tokens
                and request.eos_token_ids and not request.sampling_params.ignore_eos):
            return min(request.eos_token_ids)
        return self._next(request.token_ids[-1] if last is None else last, request.num_tokens + ahead,
                          request.eos_token_ids)

    def _next(self, last: int, num_tokens: int, eos_token_ids: Any) -> int:
        """The deterministic stand-in token after ``last`` at a length of ``num_tokens``: never EOS."""
        token = (last * 31 + num_tokens) % self.vocab_size
        while token in eos_token_ids:
            token = (token + 1) % self.vocab_size
        return token


def simulated_engine(config: EngineConfig, step_time: StepTimeFn, *, scheduler: PluginSpec = "fcfs",
                     allocator: PluginSpec = "paged", attention: PluginSpec = "torch",
                     target_len: Callable[[Request], int] | None = None, tokenizer: Any = None,
                     hf_config: Any = None, kv_links: Mapping[str, Mapping[str, float]] | None = None,
                     acceptance: AcceptanceModel | None = None, fast_forward: bool = False) -> LLMEngine:
    """An ``LLMEngine`` with the real scheduler, policy and allocator on a ``SimulatedRunner`` (its virtual
    clock is ``engine.clock``). Loads the model's config and tokenizer only; KV blocks come from
    ``num_kv_blocks`` or ``kv_cache_memory`` (or ``kv_cache_fraction`` of this machine's free memory). A model
    directory holding only a ``config.json`` (an architecture to simulate, no weights) is tokenized with the
    default model's tokenizer. ``tokenizer``, ``hf_config``: use these instead of loading them (replicas of a
    simulated cluster share them). ``kv_links``: the KV tiers' links (``hardware.kv_tier_links``).
    ``acceptance``: how proposals are made and accepted, with ``config.speculative``.
    ``fast_forward``: decode stretches (``SimulatedRunner``)."""
    from transformers import AutoTokenizer

    if tokenizer is None:
        model_dir = resolve_model(config.model)
        has_tokenizer = any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                                     "tokenizer.model"))
        # None: LLMEngine loads the model directory's own.
        tokenizer = None if has_tokenizer else AutoTokenizer.from_pretrained(resolve_model(None))
    runner = {"name": "sim", "step_time": step_time, "target_len": target_len, "kv_links": kv_links,
              "acceptance": acceptance, "fast_forward": fast_forward}
    return LLMEngine(config, scheduler=scheduler, allocator=allocator, attention=attention, runner=runner,
                     tokenizer=tokenizer, hf_config=hf_config)
