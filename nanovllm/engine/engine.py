"""The engine loop: add requests, then ``step()`` until none is unfinished. One step = schedule, run the
model once over the flat batch, hand the sampled tokens to the scheduler (which appends them and finishes
requests), and return what happened: the requests that ended and the step's record. The engine keeps no
history of its own: whoever drives it (``LLM``, the serving loop, the simulator) keeps what it needs."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer

from nanovllm.allocator import ALLOCATORS, BlockAllocator
from nanovllm.attention.base import ATTENTION_BACKENDS, AttentionBackend, resolve_attention
from nanovllm.attention.kv_quant import row_elements, storage_dtype
from nanovllm.config import EngineConfig, max_positions_of
from nanovllm.engine.cuda_graphs import GraphSettings
from nanovllm.engine.decode_stretch import decode_stretch, stretch_blocker
from nanovllm.engine.kv_cache import bytes_per_block, decide_num_blocks
from nanovllm.engine.kv_offload import KVOffload, check_kv_offload, kv_namespace
from nanovllm.engine.protocol import EngineClient, StepError, StepOutput, StepsAhead
from nanovllm.engine.runner import RUNNERS, Runner, RunnerContext, resolve_runner, runner_class
from nanovllm.engine.scheduler import PolicyError, Scheduler, SchedulerOutput
from nanovllm.engine.speculative import Speculator
from nanovllm.engine.startup_checks import check_before_load
from nanovllm.engine.warmup import warm_up
from nanovllm.kv_tiers import TierContext
from nanovllm.models.loader import resolve_model
from nanovllm.outputs import StepColumns, StepRecord
from nanovllm.policy import POLICIES, Policy
from nanovllm.proposer import ProposerContext, ProposerError, check_speculative
from nanovllm.request import KVHandoff, Request, RequestStatus
from nanovllm.sampling import SamplingParams
from nanovllm.spec_policy import check_spec_policy

logger = logging.getLogger(__name__)

PluginSpec = Any  # a registered name, an instance, or a mapping {"name": ..., **constructor options}


class LLMEngine(EngineClient):
    """Owns the runner and the scheduler (with its policy and allocator). Requests go in through
    ``make_request`` + ``add_request``; ``step()`` runs one step and returns what ended in it. One request's
    path: ``LLM.generate`` -> ``make_request`` (tokenize, validate) -> ``add_request`` (waiting queue) ->
    ``step``: ``Scheduler.schedule`` -> ``Runner.execute`` -> ``Scheduler.update_from_output`` (tokens
    appended, stop checked, blocks freed) -> ``LLM`` turns the finished ``Request`` into a ``RequestOutput``."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: PluginSpec = "fcfs",
        allocator: PluginSpec = "paged",
        attention: PluginSpec = "auto",
        runner: PluginSpec = "real",
        tokenizer: Any = None,
        hf_config: Any = None,
    ) -> None:
        """``runner``: a registered runner (``RUNNERS``: ``real``, the model in this process, the default;
        ``tp``, split over ``tensor_parallel_size`` processes, which ``real`` means when that is > 1; ``sim``, a
        step-time model on a virtual clock), as a name, ``{"name": ..., **options}`` or a ``Runner`` instance.
        The engine's clock is the runner's (``Runner.clock``). ``tokenizer``, ``hf_config``: None loads
        the model directory's own (a simulated cluster's replicas share one of each)."""
        self.config = config
        runner = resolve_runner(runner, config)
        loads_model = runner_class(runner).loads_model  # an unknown runner name fails here, before any load
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available() and loads_model:
            raise ValueError("device='cuda' was asked for but CUDA is not available; use device='cpu'")
        self.model_dir = resolve_model(config.model, weights=config.quantization != "gguf")
        self.hf_config = hf_config if hf_config is not None else AutoConfig.from_pretrained(
            self.model_dir, trust_remote_code=False)
        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(
            self.model_dir, trust_remote_code=False)
        self.max_model_len = _max_model_len(config, self.hf_config)
        check_before_load(config, self.hf_config, self.max_model_len, scheduler, allocator, attention, device,
                          loads_model)
        _check_speculation(config, runner)
        attention = resolve_attention(attention, device)
        self.runner: Runner = runner if isinstance(runner, Runner) else RUNNERS.build(
            runner, RunnerContext(config, self.hf_config, self.model_dir, attention))
        self.clock: Callable[[], float] = self.runner.clock
        self._init_kv_cache(attention, device, loads_model)
        # Before the first request's clock starts, every representative batch shape runs once (warmup.py).
        self.warmup_steps, self.warmup_time = self._warm_up() if config.warmup and loads_model else (0, 0.0)
        runner = self.runner
        self.allocator: BlockAllocator = ALLOCATORS.build(allocator, self.num_kv_blocks, config.block_size)
        self.policy: Policy = POLICIES.build(scheduler)
        self.offload = self._build_offload(loads_model)
        self.scheduler = Scheduler(self.policy, self.allocator, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, offload=self.offload,
                                   preemption_mode=config.preemption_mode)
        # Speculative decoding (EngineConfig.speculative): the proposer, asked before each step.
        self.speculator: Speculator | None = None if config.speculative is None else Speculator(
            config, ProposerContext(config, self.hf_config, self.model_dir, self.hf_config.vocab_size, runner))
        eos = self.hf_config.eos_token_id
        self.eos_token_ids = frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.vocab_size = self.hf_config.vocab_size
        # Checked at submission, never inside a step (where top-k beyond the vocabulary would fail the batch).
        self.max_logprobs = min(config.max_logprobs, self.vocab_size)
        self._ids = itertools.count()
        self._num_steps = 0
        self._evictions_seen = 0
        # Decode stretches (a simulated engine with fast_forward): steps computed ahead, handed out by step().
        self._horizon: float | None = None
        # The stretch's records in runs (its segments), their start times, and the runs as one (made when a step
        # is handed out alone); steps before _stretch_next are handed out.
        self._stretch_parts: list[StepColumns] | None = None
        self._stretch_starts = np.empty(0)
        self._stretch: StepColumns | None = None
        self._stretch_next = 0
        self._stretch_ended: dict[int, list[Request]] = {}   # step of the stretch -> the requests that end in it
        # A stretch runs through the steps where requests finish (they end inside it), unless the driver says
        # it must not: a cluster whose router hears each finish in order (``Router.on_finish`` of its own).
        self.stretch_through_finishes = True
        # (step count, horizon) at which no stretch could be taken: not tried again until a step runs, the
        # horizon moves or a request is added or aborted (a cluster asks before its step, and the step asks).
        self._no_stretch_at: tuple[int, float] | None = None
        self.num_steps_ahead = 0   # steps this engine took as parts of decode stretches (of ``num_steps``)

    def _init_kv_cache(self, attention: PluginSpec, device: torch.device, loads_model: bool) -> None:
        """Size the KV cache in blocks (``EngineConfig.num_kv_blocks`` or the memory it may take), build the
        attention backend and let the runner allocate the cache (and capture CUDA graphs where they apply)."""
        config, runner = self.config, self.runner
        block_bytes = bytes_per_block(runner.num_layers, runner.num_kv_heads, runner.head_dim, config.block_size,
                                      runner.dtype, config.kv_cache_dtype)
        self.num_kv_blocks = decide_num_blocks(config, block_bytes, self.max_model_len, device)
        self.kv_block_bytes = block_bytes
        # A runner without a model (the simulator) attends nothing: no backend, so no kernel build on its way.
        backend: AttentionBackend | None = ATTENTION_BACKENDS.build(
            attention, runner.num_heads, runner.num_kv_heads, runner.head_dim, runner.head_dim ** -0.5
        ) if loads_model else None
        graphs = (backend is not None and device.type == "cuda" and not config.enforce_eager
                  and backend.supports_cuda_graphs)
        runner.init_kv_cache(self.num_kv_blocks, config.block_size, backend,
                             GraphSettings(config.max_num_seqs, self.max_model_len) if graphs else None)

    def _build_offload(self, loads_model: bool) -> KVOffload | None:
        """The KV tiers of ``config.kv_offload`` (None when off), told of the allocator's evictions. With the
        real runner blocks are copied out of and into its cache; with the simulated one (``sim``) the same tier
        and offload-policy classes run payload-free (``TierContext.payload``) on ``meta`` tensors of the
        cache's block geometry, and the runner charges each step the time the moves take
        (``Runner.bind_kv_offload``)."""
        config = self.config
        if check_kv_offload(config.kv_offload) is None:
            if config.preemption_mode == "swap":
                raise ValueError("preemption_mode=swap sends a victim's blocks to a KV tier: set kv_offload "
                                 "(e.g. kv_offload='host')")
            return None
        runner = self.runner
        simulated = not loads_model and runner.registered_name == "sim"
        if not simulated and (not loads_model or runner.registered_name != "real"):
            raise ValueError(f"kv_offload copies K/V between the cache and its tiers in this process: it needs "
                             f"runner real or sim, not {runner.registered_name!r}")
        namespace = kv_namespace(self.model_dir, config.dtype, config.kv_cache_dtype, config.block_size,
                                 runner.num_layers, runner.num_kv_heads, runner.head_dim, config.fast_path)
        read_blocks: Callable[[list[int]], torch.Tensor]
        write_blocks: Callable[[list[int], torch.Tensor], None]
        if simulated:
            cache_dtype = storage_dtype(config.kv_cache_dtype, runner.dtype)
            row = row_elements(runner.head_dim, config.kv_cache_dtype)
            geometry = (runner.num_layers, 2, config.block_size, runner.num_kv_heads, row)

            def read_blocks(ids: list[int]) -> torch.Tensor:   # a shape and a dtype: what the bytes count from
                return torch.empty(geometry[:2] + (len(ids),) + geometry[2:], dtype=cache_dtype, device="meta")

            def write_blocks(ids: list[int], data: torch.Tensor) -> None:
                """Nothing to write: the allocator's block ids are the simulated cache."""
        else:
            cache_dtype = runner.read_kv([0]).dtype
            read_blocks = runner.read_kv

            def write_blocks(ids: list[int], data: torch.Tensor) -> None:
                runner.write_kv(ids, data, 0)
        offload = KVOffload(config.kv_offload, TierContext(namespace, cache_dtype, payload=not simulated),
                            config.block_size, read_blocks, write_blocks)
        self.allocator.evict_listener = offload.on_evicted
        runner.bind_kv_offload(offload)
        return offload

    def close(self) -> None:
        """Close the KV tiers (a disk tier with ``persist=False`` removes its files); idempotent."""
        if self.offload is not None:
            self.offload.close()

    def _warm_up(self) -> tuple[int, float]:
        """Run every representative batch shape once (``warmup.py``); (steps, seconds)."""
        config = self.config
        try:
            steps, seconds = warm_up(self.runner, config.max_num_seqs, config.max_num_batched_tokens,
                                     self.max_model_len, self.num_kv_blocks, config.block_size,
                                     self.hf_config.vocab_size)
        except Exception as exc:
            raise RuntimeError(f"engine warm-up failed (engine.warmup=false skips it): {type(exc).__name__}: "
                               f"{exc}") from exc
        logger.info("warm-up: %d steps on representative batch shapes in %.2f s (engine.warmup=false skips it)",
                    steps, seconds)
        return steps, seconds

    # -- requests --------------------------------------------------------------------------------------------
    def make_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        client_id: str | None = None,
        request_id: str | None = None,
        slo_ttft: float | None = None,
        slo_e2el: float | None = None,
        session_id: str | None = None,
    ) -> Request:
        """Tokenize and validate a request without adding it (raises ``ValueError`` naming the bad field)."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate(max_logprobs=self.max_logprobs)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if not isinstance(prompt, (str, list, tuple)):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_tokens(token_ids, params)
        request = Request(
            request_id=request_id if request_id is not None else str(next(self._ids)),
            prompt_token_ids=token_ids, sampling_params=params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            priority=priority, client_id=client_id, prompt=text, eos_token_ids=self.eos_token_ids,
            slo_ttft=slo_ttft, slo_e2el=slo_e2el, session_id=session_id,
        )
        if params.seed is not None:
            request.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        return request

    def _validate_tokens(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        if not _token_ids_in_range(token_ids, self.vocab_size):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len ({self.max_model_len}); shorten the prompt or lower max_tokens"
            )
        blocks = self.allocator.blocks_for(total)
        if blocks > self.num_kv_blocks:
            raise ValueError(
                f"prompt + max_tokens = {total} tokens need {blocks} KV blocks but the whole cache has "
                f"num_kv_blocks={self.num_kv_blocks}; raise num_kv_blocks/kv_cache_memory or lower max_tokens"
            )

    def add_request(self, request: Request, error: str | None = None) -> None:
        """Queue ``request`` for scheduling (it joins the waiting queue and the policy hears ``on_arrival``).

        With ``error`` (the reason ``make_request`` refused it), the request is not run: it ends with status
        failed and that reason, and the next ``step()`` reports it among the finished, so a caller that serves a
        stream of requests sees every one of them end through ``step()``."""
        self._no_stretch_at = None   # the engine's state changes: a stretch may be possible
        if error is not None:
            self.scheduler.reject(request, error, self.clock())
        else:
            request.sampling_params.validate(max_logprobs=self.max_logprobs)  # a Request built by hand, too
            self.scheduler.add(request, self.clock())

    def add_handed_off(self, request: Request) -> None:
        """Prefill/decode disaggregation: queue ``request``, prefilled on another engine and carrying its K/V in
        ``request.handoff``, to decode here. It waits like any request; at admission the scheduler allocates its
        blocks (prefix-cache hits first) and the step loads the K/V into them instead of computing the prompt.
        K/V of another geometry (model, dtype, block size) fail the request with the reason; the others go on.
        A failed transfer (``handoff.failed``) brings no K/V: the request computes its prompt here."""
        self._no_stretch_at = None   # the engine's state changes: a stretch may be possible
        handoff = request.handoff
        error = None
        if handoff is None or handoff.loaded:
            raise ValueError(f"request {request.request_id}: add_handed_off needs a request with K/V to load")
        if handoff.failed:   # the transfer failed: no K/V to check or load, the prompt is computed here
            handoff.data = None
        elif not 0 < handoff.num_tokens < request.num_tokens:
            error = (f"kv transfer: {handoff.num_tokens} tokens of K/V for a request of {request.num_tokens} "
                     "tokens (expected its prompt)")
        else:
            error = self.runner.check_kv(handoff.data, self.allocator.blocks_for(handoff.num_tokens))
        if error is None and self.allocator.blocks_for(request.num_prompt_tokens + request.max_tokens) > \
                self.num_kv_blocks:
            error = (f"kv transfer: prompt + max_tokens need more than this decode replica's "
                     f"num_kv_blocks={self.num_kv_blocks}")
        request.status = RequestStatus.WAITING
        request.hand_off_after_prefill = False
        request.num_computed_tokens = 0
        request.block_table = []
        handoff.arrival_time = self.clock()
        if error is not None:
            handoff.data = None
            self.scheduler.reject(request, error, self.clock())
            return
        self.scheduler.add(request, self.clock())

    def rejected_request(self, prompt: str | list, sampling_params: SamplingParams, **fields: Any) -> Request:
        """A ``Request`` carrying what is known of a prompt that ``make_request`` refused, to pass to
        ``add_request(request, error=...)`` (its token ids are kept only when they are a plain list)."""
        token_ids = self._best_effort_tokens(prompt)
        fields.setdefault("arrival_time", self.clock())
        fields.setdefault("request_id", str(next(self._ids)))
        return Request(prompt_token_ids=token_ids, sampling_params=sampling_params,
                       prompt=prompt if isinstance(prompt, str) else None, eos_token_ids=self.eos_token_ids,
                       **fields)

    def _best_effort_tokens(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt) if isinstance(prompt, (list, tuple)) else []

    def abort_request(self, request_id: str, reason: str = "aborted") -> bool:
        """End the waiting or running request ``request_id`` now (status aborted, ``finish_reason`` "abort",
        ``error`` = ``reason``), freeing its KV blocks at once; the next ``step()`` reports it among the
        finished and the other requests go on. An unknown or already-ended id is a no-op: it is logged and
        False is returned, never raised, so a serving loop can abort freely."""
        self._no_stretch_at = None   # the engine's state changes: a stretch may be possible
        if self.scheduler.abort(request_id, self.clock(), reason) is None:
            logger.info("abort_request(%r): no waiting or running request has this id; nothing to abort",
                        request_id)
            return False
        return True

    def abort_all(self, reason: str = "aborted") -> list[str]:
        """Abort every waiting and running request; returns their ids (reported by the next ``step()``)."""
        ids = [r.request_id for r in (*self.scheduler.running, *self.scheduler.waiting)]
        for request_id in ids:
            self.abort_request(request_id, reason)
        return ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.has_stretch()

    def set_horizon(self, t: float | None, upcoming: Sequence[float] = ()) -> None:
        """The driver's promise before a step: no request is added or aborted before ``t`` on ``clock``
        (``math.inf``: none will be); None: nothing is promised (the default). With it, a simulated engine with
        ``fast_forward`` computes the pure-decode steps that start before ``t`` at once and hands them out one
        ``step()`` at a time, each exactly as stepping would give it (``nanovllm.engine.decode_stretch``).
        ``upcoming`` (the later arrivals) is not needed by one engine: its next request is its next arrival."""
        self._horizon = t

    def next_step_time(self) -> float:
        """When the next ``step()`` starts on ``clock``: a step computed ahead (a decode stretch) started at its
        recorded time, which the clock has already passed; otherwise now."""
        if self._stretch_parts is not None:
            return float(self._stretch_starts[self._stretch_next])
        return self.clock()

    def has_stretch(self) -> bool:
        """Whether the next ``step()`` hands out a step computed ahead (no request starts in it; requests may
        end in it, as ``steps_ahead_ended`` says)."""
        return self._stretch_parts is not None

    def steps_ahead_ended(self) -> dict[int, list[Request]]:
        """The requests that end in the steps computed ahead not handed out yet: position among those steps
        (0: the next) -> the requests ending in it, in the order ``step()`` reports them. Their state is already
        that after the stretch (finished, blocks freed)."""
        first = self._stretch_next
        return {j - first: requests for j, requests in self._stretch_ended.items() if j >= first}

    def steps_ahead_starts(self) -> np.ndarray | None:
        """When each step computed ahead that ``step()`` would hand out next starts (a decode stretch's steps not
        handed out yet, in order); None when the next step is not one. With a horizon set (``set_horizon``), a
        decode stretch is computed now if one can be taken. A driver that keeps its books in bulk reads how many
        it wants here, then takes them (``take_steps_ahead``)."""
        if self._stretch_parts is None and self._horizon is not None:
            self._start_stretch()
        if self._stretch_parts is None:
            return None
        return self._stretch_starts[self._stretch_next:]

    def steps_ahead_column(self, key: str) -> np.ndarray:
        """``key``'s values over the steps computed ahead not handed out yet (``steps_ahead_starts`` said there
        are such steps)."""
        assert self._stretch_parts is not None
        parts = self._stretch_parts
        values = parts[0].value(key) if len(parts) == 1 else np.concatenate([part.value(key) for part in parts])
        return values[self._stretch_next:]

    def take_steps_ahead(self, count: int | None = None) -> StepsAhead | None:
        """``EngineClient.take_steps_ahead``: the next ``count`` steps computed ahead (default: the rest of the
        decode stretch the next ``step()`` would start or continue), handed out at once as columns, each record
        what ``step()`` would have given, with the requests that ended in them; None when the next step is not
        one."""
        starts = self.steps_ahead_starts()
        if starts is None:
            return None
        assert self._stretch_parts is not None   # (it has the starts)
        first = self._stretch_next
        stop = len(self._stretch_starts) if count is None else first + count
        # The whole stretch as its runs; part of it cut from the runs as one.
        parts = self._stretch_parts if first == 0 and stop == len(self._stretch_starts) else \
            [self._stretch_columns().take(first, stop)]
        ended = [(j - first, request) for j, requests in sorted(self._stretch_ended.items()) if first <= j < stop
                 for request in requests]
        self._hand_out(stop - first)
        return StepsAhead(parts, ended)

    def _stretch_columns(self) -> StepColumns:
        """The stretch's runs as one set of columns (made once, when needed)."""
        assert self._stretch_parts is not None
        if self._stretch is None:
            self._stretch = StepColumns.concatenate(self._stretch_parts)
        return self._stretch

    def _hand_out(self, count: int) -> None:
        """The next ``count`` steps computed ahead are handed out."""
        assert self._stretch_parts is not None and self._stretch_next + count <= len(self._stretch_starts)
        self._stretch_next += count
        if self._stretch_next == len(self._stretch_starts):
            self._stretch_parts, self._stretch, self._stretch_next, self._stretch_ended = None, None, 0, {}
            self._stretch_starts = np.empty(0)

    def _start_stretch(self) -> None:
        assert self._horizon is not None
        at = (self._num_steps, self._horizon)
        if at == self._no_stretch_at:
            return
        if stretch_blocker(self) is None:
            stretch = decode_stretch(self, self._horizon)
            if stretch is not None:
                parts, self._stretch_ended = stretch
                self._stretch_parts, self._stretch = parts, None
                self._stretch_starts = parts[0].columns["start_time"] if len(parts) == 1 else \
                    np.concatenate([part.columns["start_time"] for part in parts])
                self.num_steps_ahead += len(self._stretch_starts)
                return
        self._no_stretch_at = at

    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) requests now, preempted ones among the waiting: what a server's gauges and its
        admission limit read between steps."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    @property
    def num_steps(self) -> int:
        """Steps this engine has run (a counter, not a history)."""
        return self._num_steps

    # -- the step --------------------------------------------------------------------------------------------
    def step(self) -> StepOutput:
        """Run one engine step: schedule, run the model over the batch, let the scheduler append the sampled
        tokens and finish requests. Returns the requests that ended in this step and the step's record.
        Raises ``PolicyError`` when the policy fails, ``StepError`` naming the culprit for anything else."""
        try:
            return self._step()
        except (PolicyError, ProposerError, StepError):
            raise
        except Exception as exc:
            raise StepError(f"engine step {self._num_steps} failed{self._culprit(exc)}: "
                            f"{type(exc).__name__}: {exc}") from exc

    def _culprit(self, exc: BaseException) -> str:
        """' in allocator 'paged' (PagedAllocator.allocate)' for the innermost plugin frame of the traceback."""
        # (A runner without a model has no backend: a frame without ``self`` must not read as that None.)
        plugins = {id(owner): role for owner, role in ((self.allocator, "allocator"),
                                                       (self.runner.backend, "attention backend"),
                                                       (self.policy, "policy")) if owner is not None}
        found = ""
        tb = exc.__traceback__
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if id(owner) in plugins:
                name = getattr(owner, "registered_name", type(owner).__name__)
                found = (f" in {plugins[id(owner)]} {name!r} "
                         f"({type(owner).__name__}.{tb.tb_frame.f_code.co_name})")
            tb = tb.tb_next
        return found

    def _step(self) -> StepOutput:
        if self._stretch_parts is None and self._horizon is not None:
            self._start_stretch()
        if self._stretch_parts is not None:
            record = self._stretch_columns().record(self._stretch_next)
            ended = self._stretch_ended.get(self._stretch_next, [])
            self._hand_out(1)
            return StepOutput(list(ended), record, None)
        start = self.clock()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.max_model_len)
        out = self.scheduler.schedule(start)
        for request, first_block in out.kv_loads:   # K/V prefilled elsewhere, into the blocks just allocated
            handoff = request.handoff
            assert handoff is not None   # the scheduler plans a load only for a request that carries K/V
            last_block = self.allocator.blocks_for(handoff.num_tokens)
            if handoff.data is not None:
                started = time.perf_counter()
                self.runner.write_kv(request.block_table[first_block:last_block], handoff.data, first_block)
                handoff.transfer_time += time.perf_counter() - started
                handoff.data = None
        layout = _BatchLayout.of(out.scheduled)
        next_tokens, next_logprobs = self.runner.execute(out.scheduled) if out.scheduled else ([], [])
        finished = self.scheduler.update_from_output(out, next_tokens, self.clock(), self.max_model_len,
                                                     next_logprobs)
        if self.speculator is not None:
            self.speculator.on_finish(finished)
        handed_off = self.scheduler.take_handed_off()
        for request in handed_off:
            self._read_kv_for_handoff(request)
        num_sampled = sum(token is not None for token in next_tokens)
        record = self._step_record(start, out, layout, num_sampled)
        if self.speculator is not None:
            self.speculator.observe_step(record)
        return StepOutput(finished, record, out, handed_off)

    def _read_kv_for_handoff(self, request: Request) -> None:
        """A prefilled request leaves this engine: its prompt's blocks are read into ``request.handoff`` (what a
        ``KVTransfer`` moves) and freed here."""
        num_blocks = self.allocator.blocks_for(request.num_prompt_tokens)
        started = time.perf_counter()
        data = self.runner.read_kv(request.block_table[:num_blocks])
        request.handoff = KVHandoff(
            prefill_replica=request.replica if request.replica is not None else 0,
            num_tokens=request.num_prompt_tokens, num_bytes=num_blocks * self.kv_block_bytes, data=data,
            prefill_end_time=self.clock(), transfer_time=time.perf_counter() - started if data is not None else 0.0)
        self.scheduler.release(request)

    def _step_record(self, start: float, out: SchedulerOutput, layout: Any, num_sampled: int,
                     kv_slots_unused: int | None = None) -> StepRecord:
        """The record of the step that just ran (``layout``: its ``_BatchLayout``; ``kv_slots_unused``: given by a
        decode stretch, which keeps the count as it goes, else summed over the running requests)."""
        self._num_steps += 1
        evictions, self._evictions_seen = self.allocator.num_evictions - self._evictions_seen, \
            self.allocator.num_evictions
        block_size = self.allocator.block_size
        record = StepRecord(
            step=self._num_steps - 1,
            start_time=start,
            duration=self.clock() - start,
            num_prefill_tokens=layout.prefill_tokens,
            num_decode_tokens=layout.decode_tokens,
            num_prefill_seqs=layout.prefill_seqs,
            num_decode_seqs=layout.decode_seqs,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preempted=len(out.preempted),
            kv_blocks_used=self.allocator.num_used_blocks(),
            kv_blocks_cached=self.allocator.num_cached_blocks(),
            kv_blocks_free=self.allocator.num_free_blocks(),
            kv_blocks_total=self.allocator.num_blocks,
            context_tokens=layout.context_tokens,
            attn_pairs=layout.attn_pairs,
            num_sampled=num_sampled,
            prefix_hit_tokens=out.num_prefix_hit_tokens,
            recomputed_tokens=out.num_recomputed_tokens,
            num_evictions=evictions,
            kv_slots_unused=kv_slots_unused if kv_slots_unused is not None else
            sum(len(r.block_table) * block_size - r.num_computed_tokens for r in self.scheduler.running),
            spec_decode_num_drafts=out.num_drafts,
            spec_decode_num_draft_tokens=out.num_draft_tokens,
            spec_decode_num_accepted_tokens=out.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=out.num_accepted_tokens_per_pos,
        )
        if self.offload is not None:
            record["swapped_tokens"], record["kv_tiers"] = self.offload.take_step_stats()
        if self.speculator is not None and self.speculator.counts_fed_tokens:
            record["spec_proposer_fed_tokens"] = self.speculator.step_fed_tokens
        return record


def _token_ids_in_range(token_ids: list[Any], vocab_size: int) -> bool:
    """Whether every id is an int (not a bool) in ``[0, vocab_size)``. Prompts run to many thousands of
    tokens and this runs once per request, so the common case (all plain ints) is checked by ``map``,
    ``count``, ``min`` and ``max`` in C rather than one Python test per token; anything else (int subclasses,
    mixed types) takes the per-token test, which gives the same answer."""
    if list(map(type, token_ids)).count(int) == len(token_ids):
        return 0 <= min(token_ids) and max(token_ids) < vocab_size
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in token_ids)


@dataclass
class _BatchLayout:
    """What a scheduled batch is made of, taken before it runs (for the step record)."""

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    decode_seqs: int = 0
    decode_tokens: int = 0   # one per decode, plus the proposals verified with it (speculative decoding)
    context_tokens: int = 0
    attn_pairs: int = 0

    @classmethod
    def of(cls, scheduled: list[tuple[Request, int]]) -> "_BatchLayout":
        layout = cls()
        for request, n in scheduled:
            cached = request.num_computed_tokens
            # A decode computes the newest output token (and any proposals after it); anything else (prompt
            # chunks, recompute) is prefill.
            if request.num_uncomputed_tokens == 1 and request.num_output_tokens > 0:
                layout.decode_seqs += 1
                layout.decode_tokens += n
            else:
                layout.prefill_seqs += 1
                layout.prefill_tokens += n
            layout.context_tokens += cached + n
            # Query-key pairs under the causal mask: new token i sees the cached tokens and i + 1 new ones.
            layout.attn_pairs += n * cached + n * (n + 1) // 2
        return layout


def batch_features(scheduled: list[tuple[Request, int]]) -> dict[str, int]:
    """The step-record features of a scheduled batch, taken before it runs: what a step-time model predicts
    from (the same keys as ``StepRecord``, so a model fitted on ``steps.jsonl`` reads them unchanged)."""
    layout = _BatchLayout.of(scheduled)
    num_sampled = sum(request.num_computed_tokens + n >= request.num_tokens for request, n in scheduled)
    return {
        "num_prefill_tokens": layout.prefill_tokens, "num_decode_tokens": layout.decode_tokens,
        "num_prefill_seqs": layout.prefill_seqs, "num_decode_seqs": layout.decode_seqs,
        "context_tokens": layout.context_tokens, "attn_pairs": layout.attn_pairs, "num_sampled": num_sampled,
    }


def _max_model_len(config: EngineConfig, hf_config: Any) -> int:
    """The longest request the engine takes: ``config.max_model_len``, else the model's positions; checked
    against the model and, without chunked prefill, against the step's token budget."""
    model_max = max_positions_of(hf_config)
    if config.max_model_len is not None and config.max_model_len > model_max:
        raise ValueError(f"max_model_len must be <= the model's max_position_embeddings ({model_max}), "
                         f"got {config.max_model_len}")
    max_model_len = config.max_model_len or model_max
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= max_model_len "
            f"({max_model_len}) when enable_chunked_prefill is False, or no long prompt could run"
        )
    return max_model_len


def _check_speculation(config: EngineConfig, runner: PluginSpec) -> None:
    """``config.speculative``'s proposer and policy options, and a runner that can verify proposals."""
    check_speculative(config)
    check_spec_policy(config.speculative)
    if config.speculative is not None and not runner_class(runner).supports_speculation:
        raise ValueError(f"speculative decoding needs a runner that verifies proposals; runner "
                         f"{runner_class(runner).registered_name!r} does not (use runner real)")
