"""The CSV request traces the serving papers replay: arrival times and token counts, no text.

* ``azure`` -- the Azure LLM inference traces (https://github.com/Azure/AzurePublicDataset, ``data/``):
  ``AzureLLMInferenceTrace_conv.csv`` and ``AzureLLMInferenceTrace_code.csv`` (2023, used by Splitwise,
  DistServe, Vidur, Llumnix) and the week-long 2024 ones (``AzureLLMInferenceTrace_conv_1week.csv``,
  ``..._code_1week.csv``). Columns ``TIMESTAMP,ContextTokens,GeneratedTokens``; the timestamp is a date and time,
  ``2023-11-16 18:15:46.6805900`` (2023: seven fractional digits) or ``2024-05-10 00:00:00.009930+00:00``
  (2024: six, and a UTC offset).
* ``vidur`` -- the processed traces of Vidur (https://github.com/microsoft/vidur, ``data/processed_traces/``,
  e.g. ``splitwise_conv.csv``): ``arrived_at,num_prefill_tokens,num_decode_tokens``, arrivals in seconds.
* ``burstgpt`` -- BurstGPT (https://github.com/HPMLL/BurstGPT, ``data/BurstGPT_1.csv``): ``Timestamp,Model,
  Request tokens,Response tokens,Total tokens,Log Type``, the timestamp in seconds from the trace's start.
  ``workload.models`` keeps the rows of some models (``ChatGPT``, ``GPT-4``), ``workload.log_types`` those of some
  log types (``Conversation log``, ``API log``).

Arrivals are made relative to the earliest request kept (a trace starts at its first request, not at the epoch),
then multiplied by ``time_scale``. The traces give no text, so each prompt is that many random token ids of the
tokenizer's vocabulary, drawn like a JSONL trace's ``prompt_len`` lines (no two prompts share a prefix: these
traces say nothing about reuse). Each request's ``max_tokens`` is its recorded output length.

A row with 0 prompt or 0 output tokens is not a request the engine can replay as recorded: in BurstGPT a
response of 0 tokens is a failed request (``BurstGPT_without_fails_*.csv`` are the same traces without them), and
a prompt of 0 tokens has nothing to prefill. ``workload.zero_tokens`` says what to do with such rows: ``skip``
them (the default, what the papers do), replay them with ``one`` token instead (so a failure still loads the
server with its prompt), or make each an ``error``. Every problem names the file and the (1-based) line.
"""

from __future__ import annotations

import csv
import datetime as dt
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from nanovllm.harness.workload.config import WorkloadRequest
from nanovllm.harness.workload.distributions import _rng
from nanovllm.harness.workload.prompts import _normal_token_ids, _random_tokens
from nanovllm.harness.workload.traces import _line_error


@dataclass(frozen=True)
class CsvTraceFormat:
    """One CSV trace layout: its arrival, prompt-length and output-length columns, and how to read an arrival."""

    name: str
    time_column: str
    prompt_column: str
    output_column: str
    parse_time: Callable[[str], float]  # a cell -> seconds (any origin: arrivals are made relative)
    time_unit: str                      # what the error message says an arrival must be

    @property
    def required(self) -> tuple[str, str, str]:
        return (self.time_column, self.prompt_column, self.output_column)


_DATETIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?")


def parse_timestamp(text: str) -> float:
    """Seconds since the epoch of an Azure trace timestamp (``2023-11-16 18:15:46.6805900``, any number of
    fractional digits, an optional ``+00:00``/``Z`` offset; none means UTC). ``datetime.fromisoformat`` takes at
    most six fractional digits in the Python versions supported, the 2023 traces have seven."""
    m = _DATETIME.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"not a date and time like 2023-11-16 18:15:46.6805900: {text!r}")
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    fraction, offset = m.group(7), m.group(8)
    tz = dt.timezone.utc
    if offset and offset != "Z":
        sign = -1 if offset[0] == "-" else 1
        digits = offset[1:].replace(":", "")
        tz = dt.timezone(sign * dt.timedelta(hours=int(digits[:2]), minutes=int(digits[2:])))
    whole = dt.datetime(year, month, day, hour, minute, second, tzinfo=tz).timestamp()
    return whole + (int(fraction) / 10 ** len(fraction) if fraction else 0.0)


def parse_seconds(text: str) -> float:
    """A finite number of seconds (``4.314579``, ``5``)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value


CSV_FORMATS: dict[str, CsvTraceFormat] = {
    "azure": CsvTraceFormat("azure", "TIMESTAMP", "ContextTokens", "GeneratedTokens", parse_timestamp,
                            "a date and time like 2023-11-16 18:15:46.6805900"),
    "vidur": CsvTraceFormat("vidur", "arrived_at", "num_prefill_tokens", "num_decode_tokens", parse_seconds,
                            "a number of seconds"),
    "burstgpt": CsvTraceFormat("burstgpt", "Timestamp", "Request tokens", "Response tokens", parse_seconds,
                               "a number of seconds"),
}
_BURSTGPT_FILTERS = {"models": "Model", "log_types": "Log Type"}


def _rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """``(line number, cells)`` of each non-blank line of a CSV file, the header first; read lazily, so a reader
    that stops after ``max_requests`` never reads the rest of a multi-GB trace."""
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:  # -sig: a spreadsheet's byte-order mark
            reader = csv.reader(f)
            for cells in reader:
                if cells and any(c.strip() for c in cells):
                    yield reader.line_num, [c.strip() for c in cells]
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}); is it really a CSV trace?") from None
    except csv.Error as e:
        raise ValueError(f"{path}: unreadable CSV ({e})") from None


def csv_header(path: Path) -> list[str]:
    """The column names of a CSV trace (its first non-blank line); an error naming the file when it has none."""
    first = next(_rows(path), None)
    if first is None:
        raise ValueError(f"{path}: the CSV trace is empty (no header line)")
    return first[1]


def detect_csv_format(path: Path) -> str:
    """The CSV format whose columns the file's header has (``workload.format=auto`` on a ``.csv``)."""
    header = set(csv_header(path))
    for name, fmt in CSV_FORMATS.items():
        if set(fmt.required) <= header:
            return name
    expected = "; ".join(f"{name}: {','.join(fmt.required)}" for name, fmt in CSV_FORMATS.items())
    raise _line_error(path, 1, f"columns {','.join(sorted(header))} match no known CSV trace ({expected}); "
                               "set workload.format")


def _token_count(cell: str, column: str, path: Path, lineno: int) -> int:
    """A token count: an integer >= 0 (``374``; ``374.0`` too, as pandas writes integer columns with a gap)."""
    try:
        value = float(cell)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise _line_error(path, lineno, f"'{column}' must be an integer >= 0, got {cell!r}")
    return int(value)


def _filters(cfg: Any, fmt: CsvTraceFormat, index: dict[str, int], path: Path) -> list[tuple[int, set[str], str]]:
    """``(column index, kept values, column name)`` of each BurstGPT filter the config sets."""
    out = []
    for key, column in _BURSTGPT_FILTERS.items():
        wanted = getattr(cfg, key, None)
        if wanted is None:
            continue
        if fmt.name != "burstgpt":
            raise ValueError(f"workload.{key}={list(wanted)!r}: only BurstGPT traces have a '{column}' column "
                             f"({path} is read as format {fmt.name})")
        if column not in index:
            raise _line_error(path, 1, f"workload.{key} filters on a '{column}' column, which this trace lacks")
        out.append((index[column], {str(v) for v in wanted}, column))
    return out


def read_csv_trace(cfg: Any, tokenizer: Any, trace_format: str) -> list[WorkloadRequest]:
    """Requests of a CSV trace in ``trace_format`` (``CSV_FORMATS``), in file order: the rows the filters
    (``models``, ``log_types``) and ``zero_tokens`` keep, at most ``cfg.max_requests`` of them."""
    fmt = CSV_FORMATS[trace_format]
    path = Path(cfg.path).expanduser()
    rows = _rows(path)
    first = next(rows, None)
    if first is None:
        raise ValueError(f"{path}: the CSV trace is empty (no header line)")
    header_line, header = first
    index = {name: i for i, name in enumerate(header)}
    missing = [c for c in fmt.required if c not in index]
    if missing:
        raise _line_error(path, header_line, f"a {fmt.name} trace needs the column(s) {', '.join(missing)}; the "
                                             f"header has {','.join(header)}")
    t_col, p_col, o_col = (index[c] for c in fmt.required)
    filters = _filters(cfg, fmt, index, path)
    zero = getattr(cfg, "zero_tokens", "skip")
    token_ids = _normal_token_ids(tokenizer)
    rng = _rng(cfg.seed, "prompts")
    kept: list[tuple[float, int, int]] = []   # (arrival, prompt tokens, output tokens)
    skipped = 0
    seen: dict[str, set[str]] = {column: set() for _, _, column in filters}
    for lineno, cells in rows:
        if len(cells) < len(header):
            raise _line_error(path, lineno, f"{len(cells)} cell(s) where the header has {len(header)} columns")
        if any(cells[i] not in values for i, values, _ in filters):
            for i, _, column in filters:
                seen[column].add(cells[i])
            continue
        try:
            t = fmt.parse_time(cells[t_col])
        except ValueError:
            raise _line_error(path, lineno, f"'{fmt.time_column}' must be {fmt.time_unit}, "
                                            f"got {cells[t_col]!r}") from None
        prompt_len = _token_count(cells[p_col], fmt.prompt_column, path, lineno)
        output_len = _token_count(cells[o_col], fmt.output_column, path, lineno)
        if prompt_len == 0 or output_len == 0:
            if zero == "error":
                empty = fmt.prompt_column if prompt_len == 0 else fmt.output_column
                raise _line_error(path, lineno, f"'{empty}' is 0 (set workload.zero_tokens=skip to leave such rows "
                                                "out, or one to replay them with one token)")
            if zero == "skip":
                skipped += 1
                continue
            prompt_len, output_len = max(prompt_len, 1), max(output_len, 1)
        kept.append((t, prompt_len, output_len))
        if cfg.max_requests is not None and len(kept) >= cfg.max_requests:
            break
    if skipped:
        logging.getLogger(__name__).info("%s: %d row(s) with 0 prompt or output tokens left out "
                                         "(workload.zero_tokens=skip)", path, skipped)
    if not kept and any(seen.values()):  # rows there were, the filters left none
        found = "; ".join(f"'{column}' values seen: {', '.join(sorted(values)) or 'none'}"
                          for column, values in seen.items())
        raise ValueError(f"{path}: no row passes workload.models / workload.log_types ({found})")
    start = min((t for t, _, _ in kept), default=0.0)
    return [WorkloadRequest(arrival_time=(t - start) * cfg.time_scale,
                            prompt=_random_tokens(token_ids, prompt_len, rng), max_tokens=output_len,
                            ignore_eos=bool(cfg.ignore_eos))
            for t, prompt_len, output_len in kept]
