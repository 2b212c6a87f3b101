"""Decode stretches: a simulated engine runs many pure-decode steps in one call, with the outcome of stepping.

A simulated run of a GPU-scale trace spends most of its engine steps decoding the same running batch: nothing
arrives, nothing finishes, nothing waits, every request computes one token. Each such step costs the Python of
a whole step (schedule, execute, update, the step record) for what is a few additions. ``decode_stretch``
computes the next run of those steps at once, in the order stepping would: per step the step-time model's
duration (the same call with the same features: context lengths grow by one a request a step), the block
allocations and prefix-cache publications at the steps where a request crosses a block boundary (in batch
order), and the step's record from the allocator's state after them; per request its stand-in tokens and
their times. The engine then hands those steps out one ``step()`` at a time (``LLMEngine.step``), so drivers,
clusters and records see exactly the steps stepping would have given.

A stretch is taken only where it is provably what stepping would do (``stretch_blocker`` says why not):

* the runner is the simulator's with ``fast_forward`` on and a pure step-time model (not ``replay``), no
  speculative decoding, no KV tiers;
* nothing waits, nothing was rejected or aborted, nothing is handed off; every running request decodes (one
  uncomputed token, an output already) and has no stop token ids of its own;
* the policy's decisions cannot change during it (``Policy.decode_stretches``: no ``on_step`` or
  ``step_budget`` of its own and a running order that never changes), the allocator's work happens only at
  block boundaries (``BlockAllocator.decode_stretches``), the batch fits the step's token budget;
* it ends before any request's finishing step (that step runs as usual), before the step that would need more
  blocks than are free (no preemption inside), and before the driver's ``horizon``: every step of it ends
  before the time the driver says the next request may come (``LLMEngine.set_horizon``).
"""

from __future__ import annotations

from typing import Any

from nanovllm.engine.protocol import StepOutput
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.request import Request

# The engine is an ``LLMEngine`` on a ``SimulatedRunner`` (neither imported: both import this module's users).
Engine = Any

#: Fewer steps than this are left to ordinary stepping (a stretch's set-up costs about a step's Python).
MIN_STRETCH = 2


def stretch_blocker(engine: Engine) -> str | None:
    """Why the engine's next steps cannot be taken as a decode stretch now; None when they can."""
    runner, scheduler = engine.runner, engine.scheduler
    if not getattr(runner, "fast_forward", False):
        return "runner without fast_forward"
    if engine.speculator is not None or engine.offload is not None:
        return "speculative decoding or KV tiers"
    if scheduler.waiting or scheduler._rejected or scheduler._handed_off or not scheduler.running:
        return "requests waiting, ending or none running"
    if not type(engine.policy).decode_stretches or not type(engine.allocator).decode_stretches:
        return "policy or allocator not declared decode_stretches"
    if len(scheduler.running) > min(scheduler.max_num_batched_tokens, scheduler.max_num_seqs):
        return "batch beyond the step's budget"
    for request in scheduler.running:
        if (request.num_uncomputed_tokens != 1 or request.num_output_tokens == 0 or request.spec_token_ids
                or request.hand_off_after_prefill or request.sampling_params.stop_token_ids):
            return f"request {request.request_id} is not a plain decode"
    return None


def _steps_to_finish(engine: Engine, request: Request) -> int:
    """The step (1 = the next) at which ``request`` ends by stepping: its target length (stand-in EOS), its
    ``max_tokens`` or the model's length (``Request.check_stop``; stop token ids were ruled out)."""
    params, produced = request.sampling_params, request.num_output_tokens
    steps = min(params.max_tokens - produced, engine.max_model_len - request.num_tokens)
    target = engine.runner.target_len(request)
    if target < params.max_tokens and request.eos_token_ids and not params.ignore_eos:
        steps = min(steps, target - produced)
    return max(1, steps)


def decode_stretch(engine: Engine, horizon: float) -> list[StepOutput]:
    """Run the engine's next pure-decode steps that end before ``horizon`` (and before any request's finishing
    step, and within the free blocks) and return their outputs in order; [] when fewer than ``MIN_STRETCH``
    qualify (nothing was changed then). The caller has checked ``stretch_blocker``."""
    runner, scheduler, allocator = engine.runner, engine.scheduler, engine.allocator
    clock = runner.clock
    now = clock.time
    running = scheduler.running
    scheduler._sort(running, now)   # what the first step's schedule does; the order then holds (a fixed key)
    batch = list(running)
    size = len(batch)
    max_steps = min(_steps_to_finish(engine, request) for request in batch) - 1
    if max_steps < MIN_STRETCH:
        return []
    block_size = allocator.block_size
    computed = [request.num_computed_tokens for request in batch]
    # Step j (0-based) computes each request's token at position computed + j: it takes a block first when that
    # position is past its table (allocator.append, in batch order), and after the step publishes the block
    # that token filled (allocator.on_tokens_computed). Free blocks must cover every allocation, so no step of
    # the stretch could preempt.
    takes = _steps_where(batch, [len(r.block_table) * block_size - c for r, c in zip(batch, computed)],
                         block_size, max_steps)
    fills = _steps_where(batch, [(-c - 1) % block_size for c in computed], block_size, max_steps)
    free = allocator.num_free_blocks()
    durations: list[float] = []
    allocated = 0
    context = sum(computed) + size        # context_tokens of the first step (each request: computed + 1)
    t = now
    step_time = runner.step_time
    for j in range(max_steps):
        allocated += len(takes.get(j, ()))
        if allocated > free:
            break
        # The features ``batch_features`` gives a pure-decode batch, in its key order.
        features = {"num_prefill_tokens": 0, "num_decode_tokens": size, "num_prefill_seqs": 0,
                    "num_decode_seqs": size, "context_tokens": context, "attn_pairs": context,
                    "num_sampled": size}
        duration = float(step_time(features, t))
        if not duration >= 0 or t + duration >= horizon:
            break   # (a negative duration is left to the step itself, which raises the model's error)
        durations.append(duration)
        t += duration
        context += size
    num_steps = len(durations)
    if num_steps < MIN_STRETCH:
        return []
    return _apply(engine, batch, computed, durations, takes, fills)


def _steps_where(batch: list[Request], first: list[int], period: int, limit: int) -> dict[int, list[int]]:
    """step -> the batch positions (in batch order) with an event at that step: request i's first at step
    ``max(0, first[i])``, then every ``period`` steps, below ``limit``."""
    steps: dict[int, list[int]] = {}
    for i in range(len(batch)):
        for j in range(max(0, first[i]), limit, period):
            steps.setdefault(j, []).append(i)
    return steps


def _apply(engine: Engine, batch: list[Request], computed: list[int], durations: list[float],
           takes: dict[int, list[int]], fills: dict[int, list[int]]) -> list[StepOutput]:
    """Make the steps of ``durations`` happen: the allocator's events in step and batch order, the clock, each
    step's record, then every request's tokens and token times."""
    runner, allocator = engine.runner, engine.allocator
    clock = runner.clock
    block_size = allocator.block_size
    size, num_steps = len(batch), len(durations)
    # The tokens first: a block published mid-stretch is keyed by its tokens, which must be there (tokens past
    # a step are never read before it: appends and publications go by num_computed_tokens, set per event).
    for request in batch:
        request.token_ids.extend(runner.stand_in_tokens(request, num_steps))
    outputs: list[StepOutput] = []
    times: list[float] = []
    slots = sum(len(request.block_table) for request in batch) * block_size
    total_computed = sum(computed)
    context = total_computed + size
    record = None
    for j in range(num_steps):
        start = clock.time
        taking, filling = takes.get(j, ()), fills.get(j, ())
        for i in taking:
            request = batch[i]
            request.num_computed_tokens = computed[i] + j
            allocator.append(request, 1)
            slots += block_size
        clock.advance(durations[j])
        for i in filling:   # after the step: the blocks this step's tokens filled are published
            request = batch[i]
            request.num_computed_tokens = computed[i] + j + 1
            allocator.on_tokens_computed(request)
        total_computed += size
        times.append(clock.time)
        if record is None or taking or filling:   # the allocator's counts may have moved: read them
            record = engine._step_record(start, SchedulerOutput(), _DecodeLayout(size, context), size,
                                         kv_slots_unused=slots - total_computed)
        else:   # only the step's number, times, context and free slots differ from the step before
            record = record.copy()
            record.update(step=engine._num_steps, start_time=start, duration=clock.time - start,
                          context_tokens=context, attn_pairs=context, kv_slots_unused=slots - total_computed,
                          num_evictions=0, spec_decode_num_accepted_tokens_per_pos=[])
            engine._num_steps += 1
        outputs.append(StepOutput([], record, None))
        context += size
    for i, request in enumerate(batch):
        request.num_computed_tokens = computed[i] + num_steps
        request.max_computed_tokens = max(request.max_computed_tokens, request.num_computed_tokens)
        request.token_times.extend(times)
    return outputs


class _DecodeLayout:
    """A pure-decode batch's ``_BatchLayout``: ``size`` decodes over ``context`` tokens of context."""

    __slots__ = ("prefill_tokens", "prefill_seqs", "decode_seqs", "decode_tokens", "context_tokens", "attn_pairs")

    def __init__(self, size: int, context: int) -> None:
        self.prefill_tokens = self.prefill_seqs = 0
        self.decode_seqs = self.decode_tokens = size
        self.context_tokens = self.attn_pairs = context   # one new token each: n * cached + 1 per request

