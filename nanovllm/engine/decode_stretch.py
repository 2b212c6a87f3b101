"""Decode stretches: a simulated engine runs many pure-decode steps in one call, with the outcome of stepping.

A simulated run of a GPU-scale trace spends most of its engine steps decoding the same running batch: nothing
arrives, nothing waits, every request computes one token, and now and then one of them finishes. Each such step
costs the Python of a whole step (schedule, execute, update, the step record) for what is a few additions.
``decode_stretch`` computes the next run of those steps at once, in the order stepping would: per step the step-time
model's duration (the same call with the same features: context lengths grow by one a request a step), the block
allocations and prefix-cache publications at the steps where a request crosses a block boundary (in batch order),
and the step's record from the allocator's state after them; per request its stand-in tokens and their times; at a
step where requests finish, their last token and their end as stepping gives them (blocks freed, the policy told),
after which the stretch goes on with the smaller batch. The records come as columns (``StepColumns``: the step-time
model is asked for a chunk of steps at once where it can, ``StepTimeModel.predict_decodes``). The engine hands those
steps out one ``step()`` at a time (``LLMEngine.step``), or all at once to a driver that keeps its books in bulk
(``EngineClient.take_steps_ahead``: a cluster interleaves its replicas' stretches in the order it would step them),
each with the requests that ended in it, so drivers, clusters and records see exactly the steps and the ends
stepping would have given.

A stretch is taken only where it is provably what stepping would do (``stretch_blocker`` says why not):

* the runner is the simulator's with ``fast_forward`` on and a pure step-time model (not ``replay``), no
  speculative decoding, no KV tiers;
* nothing waits, nothing was rejected or aborted, nothing is handed off; every running request decodes (one
  uncomputed token, an output already) and has no stop token ids of its own;
* the policy's decisions cannot change during it (``Policy.decode_stretches``: no ``on_step`` or
  ``step_budget`` of its own and a running order that never changes), the allocator's work happens only at
  block boundaries (``BlockAllocator.decode_stretches``), the batch fits the step's token budget;
* it ends before the step that would need more blocks than are free (no preemption inside), when the last
  request has finished, and before the driver's ``horizon``: every step of it starts before the time the
  driver says the next request may come (``LLMEngine.set_horizon``; a request that comes during a step waits
  for the next, which is not in the stretch); and before any request's finishing step where the driver says
  so (``LLMEngine.stretch_through_finishes`` false: a cluster whose router hears each finish).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nanovllm.allocator import BlockAllocator
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.outputs import StepColumns, StepRecord
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


#: The requests that end in a stretch: step (0-based, within the stretch) -> those ending there, in batch order.
Ended = dict[int, list[Request]]


def decode_stretch(engine: Engine, horizon: float) -> tuple[list[StepColumns], Ended] | None:
    """Run the engine's next pure-decode steps that start before ``horizon`` (and within the free blocks) and
    return their records in order (in runs: one a segment, below), with the requests that end in them; None
    when none qualify (nothing was changed then).

    With ``engine.stretch_through_finishes`` (the default), a step in which requests finish is taken too: it
    ends a segment of the stretch, those requests end there as stepping ends them (their last token, their
    blocks freed, the policy told), and the next segment decodes the smaller batch. Without it, the stretch
    ends before the first finishing step. A stretch whose first segment neither finishes a request nor has
    ``MIN_STRETCH`` steps is not taken. The caller has checked ``stretch_blocker``."""
    through = getattr(engine, "stretch_through_finishes", True)
    parts: list[StepColumns] = []
    ended: Ended = {}
    taken = 0
    while engine.scheduler.running:
        segment = _segment(engine, horizon, through, first=not parts)
        if segment is None:
            break
        columns, finished = segment
        parts.append(columns)
        if finished:
            ended[taken + len(columns) - 1] = finished
        taken += len(columns)
        if not through or not finished:   # it ended at the horizon or the free blocks (or before a finish)
            break
    if not parts:
        return None
    return parts, ended


def _segment(engine: Engine, horizon: float, through: bool,
             first: bool) -> tuple[StepColumns, list[Request]] | None:
    """One segment of a stretch: the steps of the running batch as it is now, up to and including its first
    finishing step (``through``; else up to the one before it), those before ``horizon`` and within the free
    blocks; None when it has no step, or (``first``) fewer than ``MIN_STRETCH`` and no finishing one."""
    runner, scheduler, allocator = engine.runner, engine.scheduler, engine.allocator
    now = runner.clock.time
    running = scheduler.running
    # What the step's schedule does first (a fixed key: the order holds through the segment; after a request
    # ends, the policy heard of it, so the next segment sorts again, as the next step's schedule would).
    scheduler._sort(running, now)
    batch = list(running)
    to_finish = [_steps_to_finish(engine, request) for request in batch]
    finish_at = min(to_finish)
    max_steps = finish_at if through else finish_at - 1
    if max_steps < 1 or (first and max_steps < MIN_STRETCH and not through):
        return None
    size = len(batch)
    block_size = allocator.block_size
    computed = [request.num_computed_tokens for request in batch]
    # The steps before the horizon first (a prefix of a longer run's), then those the free blocks allow.
    durations = _durations(runner, size, sum(computed) + size, now, horizon, max_steps)
    # Step j (0-based) computes each request's token at position computed + j: it takes a block first when that
    # position is past its table (allocator.append, in batch order), and after the step publishes the block
    # that token filled (allocator.on_tokens_computed, unless the allocator publishes nothing). Free blocks
    # must cover every allocation, so no step of the stretch could preempt.
    num_steps = len(durations)
    takes = _steps_where(batch, [len(r.block_table) * block_size - c for r, c in zip(batch, computed)],
                         block_size, num_steps)
    publishes = type(allocator).on_tokens_computed is not BlockAllocator.on_tokens_computed
    fills = _steps_where(batch, [(-c - 1) % block_size for c in computed], block_size, num_steps) \
        if publishes else {}
    taken = np.zeros(num_steps, dtype=np.int64)   # blocks step j takes
    for j, positions in takes.items():
        taken[j] = len(positions)
    # Free blocks must cover every allocation up to the step (no preemption inside).
    within = int(np.searchsorted(np.cumsum(taken) > allocator.num_free_blocks(), True))
    finishes = through and within == finish_at   # (num_steps <= max_steps = finish_at, so within <= finish_at)
    if within < 1 or (first and within < MIN_STRETCH and not finishes):
        return None
    finishing = [i for i in range(size) if to_finish[i] == within] if finishes else []
    return _apply(engine, batch, computed, durations[:within], takes, fills, finishing)


#: Steps whose durations a model with ``predict_decodes`` is asked for at once, at first (then twice as many).
FIRST_CHUNK = 32


def _durations(runner: Any, size: int, context: int, now: float, horizon: float, limit: int) -> np.ndarray:
    """The durations of the next pure-decode steps of ``size`` requests (the first over ``context`` tokens of
    context, each one ``size`` more), at most ``limit`` of them, all starting before ``horizon``: the step-time
    model asked with the features ``batch_features`` gives such a batch, step by step or (``predict_decodes``)
    a chunk at once. A step the model gives a negative (or NaN) duration ends the stretch before it: the step
    itself then raises the model's error."""
    model = getattr(runner.step_time, "__self__", None)
    predict_decodes = getattr(model, "predict_decodes", None)
    out: list[np.ndarray] = []
    t, done, chunk = now, 0, FIRST_CHUNK
    while done < limit:
        count = min(chunk, limit - done)
        chunk_durations = None if predict_decodes is None else \
            predict_decodes(size, context + size * np.arange(done, done + count))
        if chunk_durations is None:   # no shortcut (asked once: the first chunk): step by step
            return _durations_step_by_step(runner, size, context, now, horizon, limit)
        # Each step's start as the clock adds it up; the first step starting at the horizon ends the stretch (a
        # request that comes during a step waits for the next one, as stepping admits it only between steps).
        starts = np.add.accumulate(np.concatenate(([t], chunk_durations)))
        ends = starts[1:]
        bad = ~(chunk_durations >= 0) | (starts[:-1] >= horizon)
        stop = int(np.argmax(bad)) if bad.any() else count
        out.append(chunk_durations[:stop])
        done += stop
        if stop < count:
            break
        t = float(ends[-1])
        chunk *= 2
    return np.concatenate(out) if out else np.empty(0)


def _durations_step_by_step(runner: Any, size: int, context: int, now: float, horizon: float,
                            limit: int) -> np.ndarray:
    """``_durations`` by one call of the step-time model a step, each at the step's own start time."""
    durations: list[float] = []
    t = now
    for j in range(limit):
        # The features ``batch_features`` gives a pure-decode batch, in its key order.
        c = context + size * j
        duration = float(runner.step_time({"num_prefill_tokens": 0, "num_decode_tokens": size,
                                           "num_prefill_seqs": 0, "num_decode_seqs": size, "context_tokens": c,
                                           "attn_pairs": c, "num_sampled": size}, t))
        if not duration >= 0 or t >= horizon:
            break
        durations.append(duration)
        t += duration
    return np.array(durations, dtype=np.float64)


def _steps_where(batch: list[Request], first: list[int], period: int, limit: int) -> dict[int, list[int]]:
    """step -> the batch positions (in batch order) with an event at that step: request i's first at step
    ``max(0, first[i])``, then every ``period`` steps, below ``limit``."""
    steps: dict[int, list[int]] = {}
    for i in range(len(batch)):
        for j in range(max(0, first[i]), limit, period):
            steps.setdefault(j, []).append(i)
    return steps


def _apply(engine: Engine, batch: list[Request], computed: list[int], durations: np.ndarray,
           takes: dict[int, list[int]], fills: dict[int, list[int]],
           finishing: list[int]) -> tuple[StepColumns, list[Request]]:
    """Make the steps of ``durations`` happen: the allocator's events in step and batch order, the clock, the
    steps' records (as columns), every request's tokens and token times; then, at the last step, the requests
    at ``finishing`` (batch positions) take their last token and end as ``Scheduler.update_from_output`` ends
    them. Returns the records and the requests that ended."""
    runner, allocator, scheduler = engine.runner, engine.allocator, engine.scheduler
    clock = runner.clock
    block_size = allocator.block_size
    size, num_steps = len(batch), len(durations)
    last = num_steps - 1
    ending = set(finishing)
    # The clock as stepping moves it, one addition a step: starts[j] is step j's start, starts[j + 1] its end.
    starts = np.add.accumulate(np.concatenate(([clock.time], durations)))
    ends = starts[1:]
    start_at, end_at = starts.tolist(), ends.tolist()
    # The tokens first: a block published mid-stretch is keyed by its tokens, which must be there (tokens past
    # a step are never read before it: appends and publications go by num_computed_tokens, set per event). A
    # request that ends takes its last token at its last step, where the runner says which (EOS at its target).
    for i, request in enumerate(batch):
        if i in ending:
            request.token_ids.extend(runner.stand_in_tokens(request, num_steps - 1))
            request.token_times.extend(end_at[:-1])
        else:
            request.token_ids.extend(runner.stand_in_tokens(request, num_steps))
            request.token_times.extend(end_at)
    steps = np.arange(engine._num_steps, engine._num_steps + num_steps)
    context = (sum(computed) + size) + size * np.arange(num_steps)
    # Slots allocated to the batch minus tokens it computed, after each step (blocks taken before it).
    taken = np.zeros(num_steps, dtype=np.int64)
    takes = {j: positions for j, positions in takes.items() if j < num_steps}   # (found up to the longest stretch)
    fills = {j: positions for j, positions in fills.items() if j < num_steps}
    for j, positions in takes.items():
        taken[j] = len(positions)
    slots = sum(len(request.block_table) for request in batch) * block_size + block_size * np.cumsum(taken)
    unused = slots - (sum(computed) + size * np.arange(1, num_steps + 1))
    # The allocator's counts move only at steps with events: read them there (and at the first step), in step
    # order, and hold them in between, as stepping's records would show.
    events = sorted({0, *takes, *fills, *([last] if ending else [])})
    rows: list[list[int]] = []   # per event, what its record reads from the allocator (_ALLOCATOR_FIELDS)
    first: StepRecord | None = None
    finished: list[Request] = []
    for j in events:
        clock.time = start_at[j]
        for i in takes.get(j, ()):
            request = batch[i]
            request.num_computed_tokens = computed[i] + j
            allocator.append(request, 1)
        clock.time = end_at[j]
        for i in fills.get(j, ()):   # after the step: the blocks this step's tokens filled are published
            request = batch[i]
            request.num_computed_tokens = computed[i] + j + 1
            allocator.on_tokens_computed(request)
        if j == last and ending:
            _computed_all(batch, computed, num_steps)   # every token counted before any request ends
            finished = _finish(engine, batch, finishing, end_at[j])
            # The record reads the batch that is left (its slots as the step left them).
            gone = {id(request) for request in finished}
            unused[j] = sum(len(batch[i].block_table) * block_size - computed[i] - num_steps
                            for i in range(size) if id(batch[i]) not in gone)
        if first is None:   # the first step's whole record: what every step of the stretch shares
            engine._num_steps = int(steps[0])
            first = engine._step_record(start_at[0], SchedulerOutput(), _DecodeLayout(size, int(context[0])),
                                        size, kv_slots_unused=int(unused[0]))
            rows.append([first[key] for key in _ALLOCATOR_FIELDS])   # type: ignore[literal-required]
        else:               # what the record of this step reads from the allocator (``LLMEngine._step_record``)
            evictions, engine._evictions_seen = allocator.num_evictions - engine._evictions_seen, \
                allocator.num_evictions
            rows.append([allocator.num_used_blocks(), allocator.num_cached_blocks(), allocator.num_free_blocks(),
                         evictions])
    # Each event's counts hold until the next event; evictions happen at events, the steps between evict none.
    held = np.diff(np.array([*events, num_steps]))
    values = np.array(rows, dtype=np.int64)
    counts = {key: np.repeat(values[:, k], held) for k, key in enumerate(_ALLOCATOR_FIELDS)}
    counts["num_evictions"] = np.zeros(num_steps, dtype=np.int64)
    counts["num_evictions"][events] = values[:, _ALLOCATOR_FIELDS.index("num_evictions")]
    engine._num_steps = int(steps[-1]) + 1
    clock.time = end_at[-1]
    if not ending:
        _computed_all(batch, computed, num_steps)
    assert first is not None   # step 0 is always an event
    columns = {"step": steps, "start_time": starts[:-1], "duration": ends - starts[:-1],
               "context_tokens": context, "attn_pairs": context, "kv_slots_unused": unused, **counts}
    if finished and num_steps > 1:   # the batch left after the last step (one step: its record says so)
        running = np.full(num_steps, size, dtype=np.int64)
        running[last] = len(scheduler.running)
        columns["num_running"] = running
    constants = {key: value for key, value in first.items() if key not in columns}
    return StepColumns(list(first), columns, constants), finished


def _computed_all(batch: list[Request], computed: list[int], num_steps: int) -> None:
    """Every request of the batch has computed its tokens of the ``num_steps`` steps."""
    for i, request in enumerate(batch):
        request.num_computed_tokens = computed[i] + num_steps
        request.max_computed_tokens = max(request.max_computed_tokens, request.num_computed_tokens)


def _finish(engine: Engine, batch: list[Request], finishing: list[int], now: float) -> list[Request]:
    """The last step of a segment has run and its tokens are counted (as ``update_from_output`` counts them
    before it appends any): each request at ``finishing`` appends the token the runner gives it and ends where
    ``check_stop`` says (``Scheduler._finish``: its blocks freed, the policy told), in batch order. Returns
    those that ended."""
    finished = []
    for i in finishing:
        request = batch[i]
        request.append_token(engine.runner._token(request), now)
        reason = request.check_stop(engine.max_model_len)
        if reason is not None:
            engine.scheduler._finish(request, reason, now)
            finished.append(request)
    return finished


# What a stretch's record reads from the allocator: constant between its events.
_ALLOCATOR_FIELDS = ("kv_blocks_used", "kv_blocks_cached", "kv_blocks_free", "num_evictions")


class _DecodeLayout:
    """A pure-decode batch's ``_BatchLayout``: ``size`` decodes over ``context`` tokens of context."""

    __slots__ = ("prefill_tokens", "prefill_seqs", "decode_seqs", "decode_tokens", "context_tokens", "attn_pairs")

    def __init__(self, size: int, context: int) -> None:
        self.prefill_tokens = self.prefill_seqs = 0
        self.decode_seqs = self.decode_tokens = size
        self.context_tokens = self.attn_pairs = context   # one new token each: n * cached + 1 per request

