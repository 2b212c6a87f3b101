"""What the engine hands out: ``RequestOutput`` (what ``LLM.generate`` returns), ``StepRecord`` (what one
``LLMEngine.step()`` did, the raw material of every serving metric and plot) and ``StepColumns`` (many steps'
records at once, column by column: the steps a simulated engine computed ahead)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict, cast

import numpy as np


class StepRecord(TypedDict):
    """One engine step. ``start_time`` is the step's ``time.perf_counter()`` as the engine returns it; the
    harness makes it relative to its run's start when it writes ``steps.jsonl``."""

    step: int
    start_time: float
    duration: float                     # seconds spent in this step (schedule + forward + sample + update)
    num_prefill_tokens: int             # prompt tokens computed this step (chunks included)
    num_decode_tokens: int              # one per decoding request
    num_prefill_seqs: int
    num_decode_seqs: int
    num_running: int                    # requests holding KV blocks after the step
    num_waiting: int                    # requests waiting (preempted ones included) after the step
    num_preempted: int                  # preemptions made while scheduling this step
    kv_blocks_used: int
    kv_blocks_cached: int               # free blocks still holding reusable prefix-cache content
    kv_blocks_free: int
    kv_blocks_total: int
    context_tokens: int                 # sum over scheduled requests of their context length after the step
    attn_pairs: int                     # (query, key) pairs attended this step, causal mask respected
    num_sampled: int                    # sequences that produced logits (and a token) this step
    prefix_hit_tokens: int              # prompt tokens served from the prefix cache at this step's admissions
    recomputed_tokens: int              # tokens computed again this step because a preemption dropped them
    num_evictions: int                  # cached blocks evicted during this step
    kv_slots_unused: int                # internal fragmentation: allocated slots of running requests not
                                        # holding a computed token, after the step
    # Speculative decoding (vLLM's names; 0 without it): requests whose proposals were verified this step, the
    # proposed tokens verified, and those the target accepted.
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    # [i]: proposals at position i (0 = first after the newest token) accepted this step, as long as the longest
    # proposal verified ([] without any); absent from the placeholder records of a Ray replica's failed step.
    spec_decode_num_accepted_tokens_per_pos: NotRequired[list[int]]
    # Tokens the proposer's own model was fed this step (present only for a proposer that runs one: ``draft``,
    # ``layer_skip``): its catch-up on each request's context plus its proposals fed back.
    spec_proposer_fed_tokens: NotRequired[int]
    # KV tiers (present only with kv_offload): tokens of swapped-out requests loaded back this step, and per
    # tier (by name) hit_tokens, blocks_written, blocks_loaded, bytes_written, bytes_loaded, failures,
    # load_seconds, write_seconds this step, and blocks / bytes held after it.
    swapped_tokens: NotRequired[int]
    kv_tiers: NotRequired[dict[str, dict[str, float]]]
    replica: NotRequired[int]           # on a cluster: the replica that ran the step


@dataclass
class StepColumns:
    """The records of ``len(self)`` consecutive steps, column by column: step ``i``'s record has, in ``keys``
    order, ``columns[key][i]`` (a numpy array, one value a step) or ``constants[key]`` (the same value in every
    step). A simulated engine hands out the steps it computed ahead (decode stretches) this way, so that a
    driver keeps the books of thousands of steps with a few array operations (``StepLoop.step_ahead``);
    ``records()`` gives the very records ``step()`` would have, one by one."""

    keys: list[str]
    columns: dict[str, np.ndarray]
    constants: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def value(self, key: str) -> np.ndarray:
        """``key``'s values, one a step (a constant broadcast; a non-numeric constant is an object array)."""
        if key in self.columns:
            return self.columns[key]
        constant = self.constants[key]
        if isinstance(constant, (int, float)) and not isinstance(constant, bool):
            return np.full(len(self), constant)
        out = np.empty(len(self), dtype=object)
        out[:] = [constant] * len(self)
        return out

    def at(self, key: str, index: int) -> Any:
        """Step ``index``'s value of ``key`` (one value, without broadcasting a constant)."""
        column = self.columns.get(key)
        return self.constants[key] if column is None else column[index]

    def record(self, index: int) -> StepRecord:
        """Step ``index``'s record, with Python numbers (and a fresh copy of a list constant) as ``step()`` gives."""
        return self.records(index, index + 1)[0]

    def records(self, start: int = 0, stop: int | None = None) -> list[StepRecord]:
        """The records of steps ``start:stop``, each a new dict."""
        stop = len(self) if stop is None else stop
        values = {key: column[start:stop].tolist() for key, column in self.columns.items()}
        out = []
        for i in range(stop - start):
            record: dict[str, Any] = {}
            for key in self.keys:
                if key in values:
                    record[key] = values[key][i]
                else:
                    constant = self.constants[key]
                    record[key] = list(constant) if isinstance(constant, list) else constant
            out.append(cast(StepRecord, record))
        return out

    def take(self, start: int, stop: int) -> StepColumns:
        """Steps ``start:stop`` as columns of their own (views of these arrays)."""
        return StepColumns(list(self.keys), {key: column[start:stop] for key, column in self.columns.items()},
                           dict(self.constants))

    def with_column(self, key: str, values: np.ndarray) -> StepColumns:
        """These steps with ``key`` set to ``values`` (appended to ``keys`` when new)."""
        keys = self.keys if key in self.keys else [*self.keys, key]
        constants = {k: v for k, v in self.constants.items() if k != key}
        return StepColumns(list(keys), {**self.columns, key: values}, constants)

    def select(self, rows: np.ndarray) -> StepColumns:
        """The steps at positions ``rows``, in that order."""
        return StepColumns(list(self.keys), {key: column[rows] for key, column in self.columns.items()},
                           dict(self.constants))

    @staticmethod
    def of_records(records: Sequence[StepRecord]) -> StepColumns:
        """Steps given one record each (every one with the same fields, ``step`` and ``start_time`` among them)
        as columns: a field with the same value of the same type in every record is a constant; integers and
        floats are numeric columns; anything else (None, lists) an object column, so that ``records()`` gives
        each value back as it was."""
        keys = list(records[0])
        columns: dict[str, np.ndarray] = {}
        constants: dict[str, Any] = {}
        for key in keys:
            values = [record[key] for record in records]   # type: ignore[literal-required]
            first = values[0]
            kinds = {type(value) for value in values}
            # (a step's number and start are columns even in one record: the columns say how many steps there are)
            if key not in ("step", "start_time") and len(kinds) == 1 and all(value == first for value in values):
                constants[key] = first
            elif kinds <= {int} or kinds <= {float}:   # (never bool: a bool column would read back as bool)
                columns[key] = np.array(values)
            else:
                column = np.empty(len(values), dtype=object)
                for position, value in enumerate(values):   # one by one: a list value must not be broadcast
                    column[position] = value
                columns[key] = column
        return StepColumns(keys, columns, constants)

    @staticmethod
    def concatenate(parts: Sequence[StepColumns]) -> StepColumns:
        """``parts``' steps one after the other."""
        if len(parts) == 1:
            return parts[0]
        return StepColumns.interleave(parts, None)

    @staticmethod
    def interleave(parts: Sequence[StepColumns], sources: np.ndarray | None) -> StepColumns:
        """One run of steps from ``parts`` (each in its own order): step ``g`` is the next step of
        ``parts[sources[g]]`` (None: the parts one after the other). A constant every part shares stays one; any
        other becomes a column."""
        keys = list(parts[0].keys)
        if any(part.keys != keys for part in parts):
            raise ValueError("steps with different record fields cannot be interleaved")
        # Stable: each part's steps keep their order, and parts lie in index order, as the concatenation below.
        order = None if sources is None else np.argsort(sources, kind="stable")
        lengths = [len(part) for part in parts]
        columns: dict[str, np.ndarray] = {}
        constants: dict[str, Any] = {}
        for key in keys:
            if all(key in part.constants for part in parts) and \
                    all(part.constants[key] == parts[0].constants[key] for part in parts):
                constants[key] = parts[0].constants[key]
                continue
            if all(key in part.constants for part in parts):   # a constant of each part: one repeat, not a fill each
                joined = _repeated([part.constants[key] for part in parts], lengths)
            else:
                joined = _joined(parts, key, lengths)
            if order is None:
                columns[key] = joined
                continue
            column = np.empty_like(joined)
            column[order] = joined
            columns[key] = column
        return StepColumns(keys, columns, constants)


def _joined(parts: Sequence[StepColumns], key: str, lengths: list[int]) -> np.ndarray:
    """``key``'s values of each part (``StepColumns.value``), concatenated: numbers straight into one array of
    the type concatenating them gives, without an array for each part's constant."""
    constants = [part.constants[key] for part in parts if key not in part.columns]
    if not constants:   # a column in every part (a stretch's step numbers, times, counts): one call
        return np.concatenate([part.columns[key] for part in parts])
    if not all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in constants):
        return np.concatenate([part.value(key) for part in parts])
    dtype = np.result_type(*(part.columns[key].dtype for part in parts if key in part.columns),
                           *(np.asarray(value).dtype for value in constants))
    out = np.empty(sum(lengths), dtype=dtype)
    start = 0
    for part, length in zip(parts, lengths):
        out[start:start + length] = part.columns[key] if key in part.columns else part.constants[key]
        start += length
    return out


def _repeated(values: list[Any], lengths: list[int]) -> np.ndarray:
    """``values[i]`` ``lengths[i]`` times, in order (``StepColumns.value`` of each part, concatenated)."""
    if all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values):
        return np.repeat(np.array(values), lengths)
    out = np.empty(sum(lengths), dtype=object)
    for position, value in enumerate(value for value, length in zip(values, lengths) for _ in range(length)):
        out[position] = value   # one by one: a list value must not be broadcast
    return out


@dataclass
class RequestMetrics:
    """When things happened to one request (``time.perf_counter`` seconds)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int
    num_cached_tokens: int
    # Prefill/decode disaggregation (None on one engine or colocated replicas): the bytes of K/V moved from the
    # prefill replica to the decode replica and the seconds moving them took (read, transfer, write).
    kv_transfer_bytes: int | None = None
    kv_transfer_time: float | None = None
    # Speculative decoding (vLLM's names; 0 without it): steps that verified proposals of this request, the
    # proposed tokens verified, and those accepted (acceptance rate: accepted / draft tokens).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


@dataclass(frozen=True)
class Logprob:
    """One candidate token's log-probability under the model and its rank (1 = most likely), as in vLLM."""

    logprob: float
    rank: int


@dataclass
class RequestOutput:
    """One request's result, in the order of the prompts given to ``generate``. ``finish_reason`` is
    ``"stop"`` (EOS or a stop token, which ends ``token_ids``), ``"length"`` (``max_tokens`` or the model's
    context reached); ``metrics`` says when things happened to it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]             # generated ids; ends with the EOS id when generation stopped on it
    finish_reason: str | None        # "stop" or "length"
    metrics: RequestMetrics
    # With SamplingParams(logprobs=k): per generated token, {token id: Logprob} for the top k and the chosen one.
    logprobs: list[dict[int, Logprob]] | None = None
