"""The plain records a run produces and the one place that writes and reads a run's files.

A run directory holds ``requests.jsonl`` (one ``RequestRecord`` per request, in the order they ended),
``steps.jsonl`` (one ``StepRecord`` per engine step), ``metrics.json`` (the summary, with its breakdowns) and
``config.json``; a run watched live (``live=web|tui``) also has ``blocks.jsonl`` (periodic snapshots of who holds
which KV block) and ``engine.json`` (the engine's sizes). ``RunWriter`` is their only writer (the jsonl logger streams through it) and ``read_run`` their
only reader (viz, the sweep summary and tests read through it), so the format lives here and nowhere else.
Metrics, loggers and plots read only these records, never engine objects, so a run can be analysed long after
the engine is gone. All times are seconds since the run started (``perf_counter`` based).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator, Mapping, TypedDict

from nanovllm.outputs import StepRecord
from nanovllm.request import Request

REQUESTS_FILE, STEPS_FILE, METRICS_FILE, CONFIG_FILE = "requests.jsonl", "steps.jsonl", "metrics.json", "config.json"
BLOCKS_FILE, ENGINE_FILE = "blocks.jsonl", "engine.json"

__all__ = ["RequestRecord", "StepRecord", "RunData", "RunWriter", "RunFilesError", "JsonlTail", "is_run_dir",
           "read_config", "read_jsonl", "read_metrics", "read_run", "request_record", "step_record"]


class RequestRecord(TypedDict):
    request_id: str
    client_id: str | None
    priority: int
    arrival_time: float                 # when the request entered the engine (its workload arrival time online)
    first_scheduled_time: float | None  # first step that ran any of its tokens
    first_token_time: float | None      # when its first output token was sampled
    finish_time: float | None           # when it finished (or failed)
    token_times: list[float]            # time of every output token, first token included
    num_prompt_tokens: int
    num_cached_tokens: int              # prompt tokens served from the prefix cache at (last) admission
    cached_tokens_by_tier: dict[str, int] | None   # those split by where they were (KV tiers), else None
    num_swapped_tokens: int             # tokens loaded back after preemptions by swap (not computed again)
    num_output_tokens: int
    num_preemptions: int
    num_recomputed_tokens: int          # tokens computed again after preemptions threw them away
    finish_reason: str | None           # "stop", "length", "abort", or None when it failed
    error: str | None                   # why it was rejected or aborted ("interrupted", ...); None when it ran
    slo_ttft: float | None              # its own TTFT target in seconds (workload.ttft_slo_ms), None: none
    slo_e2el: float | None              # its own end-to-end target in seconds (workload.e2el_slo_ms)
    session_id: str | None              # its conversation (multi-turn workloads), None: none
    replica: int | None                 # the cluster replica that served it (cluster.replicas > 1), else None
    # Prefill/decode disaggregation (None otherwise): where it was prefilled, the K/V it moved (bytes; seconds to
    # read, move and write them), when they joined the decode replica (``replica``) and when it first ran there.
    prefill_replica: int | None
    kv_transfer_bytes: int | None
    kv_transfer_time: float | None
    kv_arrival_time: float | None
    decode_start_time: float | None
    kv_transfer_failed: bool            # its K/V transfer failed: the decode replica computed the prompt itself
    # Cluster faults: times it resumed on another replica after its replica died, the replicas it was on then
    # (in order), and the tokens those had computed that were computed again (prompt + generated tokens).
    num_retries: int
    retried_from: list[int]
    retry_recomputed_tokens: int
    # Speculative decoding (0 without it; vLLM's names): steps that verified its proposals, the proposed tokens
    # verified, and those accepted (what the simulator's acceptance model is fitted to: runner.acceptance).
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    # What the proposer did for it before the scheduler dropped any proposal for lack of budget or KV blocks: steps
    # it was asked for tokens, steps it proposed some, tokens it proposed (Request.num_proposer_asks ...).
    spec_proposer_asks: int
    spec_proposals: int
    spec_proposal_tokens: int


def request_record(request: Request, t0: float) -> RequestRecord:
    """``request`` as a plain record, its times made relative to the run's start ``t0``."""

    def rel(t: float | None) -> float | None:
        return None if t is None else t - t0

    handoff = request.handoff
    return RequestRecord(
        request_id=request.request_id,
        client_id=request.client_id,
        priority=request.priority,
        arrival_time=request.arrival_time - t0,
        first_scheduled_time=rel(request.first_scheduled_time),
        first_token_time=rel(request.first_token_time),
        finish_time=rel(request.finish_time),
        token_times=[t - t0 for t in request.token_times],
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        cached_tokens_by_tier=(dict(request.num_cached_tokens_by_tier)
                               if request.num_cached_tokens_by_tier is not None else None),
        num_swapped_tokens=request.num_swapped_tokens,
        num_output_tokens=request.num_output_tokens,
        num_preemptions=request.num_preemptions,
        num_recomputed_tokens=request.num_recomputed_tokens,
        finish_reason=request.finish_reason,
        error=request.error,
        slo_ttft=request.slo_ttft,
        slo_e2el=request.slo_e2el,
        session_id=request.session_id,
        replica=request.replica,
        prefill_replica=handoff.prefill_replica if handoff is not None else None,
        kv_transfer_bytes=handoff.num_bytes if handoff is not None else None,
        kv_transfer_time=handoff.transfer_time if handoff is not None else None,
        kv_arrival_time=rel(handoff.arrival_time) if handoff is not None else None,
        decode_start_time=rel(handoff.decode_start_time) if handoff is not None else None,
        kv_transfer_failed=handoff is not None and handoff.failed,
        num_retries=request.num_retries,
        retried_from=list(request.retried_from),
        retry_recomputed_tokens=request.retry_recomputed_tokens,
        spec_decode_num_drafts=request.num_drafts,
        spec_decode_num_draft_tokens=request.num_draft_tokens,
        spec_decode_num_accepted_tokens=request.num_accepted_tokens,
        spec_proposer_asks=request.num_proposer_asks,
        spec_proposals=request.num_proposals,
        spec_proposal_tokens=request.num_proposal_tokens,
    )


def step_record(record: StepRecord, t0: float, step: int) -> StepRecord:
    """The engine's step record renumbered as the run's ``step``-th, its start relative to the run's ``t0``."""
    return StepRecord(**{**record, "step": step, "start_time": record["start_time"] - t0})


# -- writing -----------------------------------------------------------------------------------------------------

def _json_default(value: Any) -> Any:
    # numpy / torch scalars become numbers; anything else (a Policy instance handed to LLM(...) ends up in the
    # config) becomes its repr, because writing a record must never crash the run it records.
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return value.item()
    if isinstance(value, (set, tuple, frozenset)):
        return list(value)
    return str(value) if isinstance(value, Path) else repr(value)


def dumps(obj: Any, **kwargs: Any) -> str:
    """JSON for a record or summary, tolerant of numpy/torch scalars and odd config values."""
    return json.dumps(obj, default=_json_default, **kwargs)


class RunFilesError(OSError):
    """A run's files cannot be written (the directory is not writable, a path is taken, the disk is full)."""


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise RunFilesError(f"cannot write the run's files in {path}: {exc.strerror or exc}"
                            f"{f' ({exc.filename})' if exc.filename else ''}") from exc


class RunWriter:
    """Writes one run directory. Steps and requests are streamed line-buffered as they happen, so a crashed or
    interrupted run keeps everything up to its last step; ``metrics.json`` is written at the summary. Any
    failure to write raises ``RunFilesError`` naming the directory and the cause."""

    def __init__(self, run_dir: str | Path, config: dict | None = None, core_files: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self._steps: IO[str] | None = None
        self._requests: IO[str] | None = None
        self._blocks: IO[str] | None = None
        with _writing(self.run_dir):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if config is not None:
                (self.run_dir / CONFIG_FILE).write_text(dumps(config, indent=2) + "\n", encoding="utf-8")
            if core_files:
                self._steps = open(self.run_dir / STEPS_FILE, "w", buffering=1, encoding="utf-8")
                self._requests = open(self.run_dir / REQUESTS_FILE, "w", buffering=1, encoding="utf-8")

    @classmethod
    def for_extras(cls, run_dir: str | Path) -> "RunWriter":
        """A writer of the live-only files (``blocks.jsonl``, ``engine.json``) beside a run whose steps and
        requests another writer owns; it leaves their files alone."""
        return cls(run_dir, core_files=False)

    def write_step(self, step: Mapping[str, Any]) -> None:
        self._write(self._steps, step)

    def write_request(self, record: Mapping[str, Any]) -> None:
        self._write(self._requests, record)

    def _write(self, stream: IO[str] | None, row: Mapping[str, Any]) -> None:
        if stream is None:
            raise RuntimeError("RunWriter is closed")
        with _writing(self.run_dir):
            stream.write(dumps(row) + "\n")  # one write of a whole line: a stop between steps never tears it

    def write_blocks(self, snapshot: dict) -> None:
        """One KV block-ownership snapshot into ``blocks.jsonl`` (opened on first use: only live runs have it)."""
        if self._blocks is None:
            self._blocks = open(self.run_dir / BLOCKS_FILE, "w", buffering=1, encoding="utf-8")
        self._write(self._blocks, snapshot)

    def write_engine_info(self, info: dict) -> None:
        """The engine's sizes (blocks, bytes per block, budgets) as ``engine.json``, for the live dashboard."""
        (self.run_dir / ENGINE_FILE).write_text(dumps(info, indent=2) + "\n", encoding="utf-8")

    def write_metrics(self, summary: dict, breakdowns: dict[str, dict] | None = None) -> None:
        metrics = {**summary, "breakdowns": breakdowns or {}}
        path = self.run_dir / METRICS_FILE
        with _writing(self.run_dir):  # written aside, then renamed: a reader never sees half a metrics.json
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(dumps(metrics, indent=2) + "\n", encoding="utf-8")
            os.replace(tmp, path)

    def close(self) -> None:
        for stream in (self._steps, self._requests, self._blocks):
            if stream is not None:
                stream.close()
        self._steps = self._requests = self._blocks = None


# -- reading -----------------------------------------------------------------------------------------------------

def read_jsonl(path: Path, missing_ok: bool = False) -> list[dict]:
    """The records of a ``.jsonl`` file; ``missing_ok``: none for a missing file (a run cut short)."""
    if missing_ok and not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_metrics(run_dir: str | Path) -> dict | None:
    """A run's ``metrics.json``, or None when the run did not get that far."""
    path = Path(run_dir) / METRICS_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def read_config(run_dir: str | Path) -> dict | None:
    """A run's ``config.json`` (the resolved config it ran with), or None when it has none."""
    path = Path(run_dir) / CONFIG_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


class JsonlTail:
    """Reads a ``.jsonl`` file that another process may still be writing, a little more at each ``read_new``.

    Only complete lines count: a last line without its newline (the writer is mid-line, or died there) is held
    back until it is completed, and ``torn`` says one is pending. A complete line that is not JSON is skipped
    and counted in ``bad_lines``, so a damaged file never stops a reader that only watches it. A file that
    does not exist yet reads as empty; one that shrank (rewritten by a new run) is read again from the start.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""
        self.bad_lines = 0

    @property
    def torn(self) -> bool:
        """Whether the file currently ends in an incomplete line (held back, not yet returned)."""
        return bool(self._partial.strip())

    def read_new(self) -> list[dict]:
        """The records appended since the last call (complete lines only)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self._offset:
            self._offset, self._partial = 0, b""
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        records = []
        for line in lines:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                self.bad_lines += 1
        return records


def is_run_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a run's files (a run in progress counts: it has ``steps.jsonl`` already)."""
    path = Path(path)
    return path.is_dir() and any((path / name).is_file() for name in (STEPS_FILE, METRICS_FILE))


@dataclass
class RunData:
    """The records of one run, as read from its directory."""

    path: Path
    requests: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    label: str = ""

    @property
    def summary(self) -> dict:
        """The scalar summary metrics (``metrics.json`` without its breakdowns)."""
        return {key: value for key, value in self.metrics.items() if key != "breakdowns"}


def read_run(run_dir: str | Path, label: str | None = None, missing_ok: bool = True) -> RunData:
    """Read a run directory. ``missing_ok``: missing files give empty records (a run cut short) instead of
    ``FileNotFoundError``; a path that is not a directory is always an error."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"not a run directory: {run_dir}")
    metrics = read_metrics(run_dir)
    if metrics is None and not missing_ok:
        raise FileNotFoundError(f"{run_dir / METRICS_FILE} is missing (the run did not finish)")
    return RunData(
        path=run_dir,
        requests=read_jsonl(run_dir / REQUESTS_FILE, missing_ok=missing_ok),
        steps=read_jsonl(run_dir / STEPS_FILE, missing_ok=missing_ok),
        metrics=metrics or {},
        label=label or run_dir.resolve().name,
    )
