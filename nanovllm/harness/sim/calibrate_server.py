"""Calibrate the simulator to whatever serves an OpenAI-compatible API, from what a client sees::

    python -m nanovllm.harness.sim.calibrate_server --url http://127.0.0.1:8000/v1 --out profile.yaml
        [--model NAME] [--dtype bfloat16] [--prompt-lens 16,64,256,512,1024] [--concurrency 1,2,4,8,16,32,64,128]
        [--output-len 32] [--burst-output-len 48] [--burst-prompt-lens 32,512] [--max-burst-tokens 40000]
        [--prefill-batches 64x8,128x8,128x15,256x4,480x4] [--mixed-steps 16x128x4,32x256x4,64x128x8]
        [--repeats 3]

then ``python -m nanovllm.run runner=sim runner.step_time=calibrated runner.profile=profile.yaml``. No step
timings are needed from the server: the calibration workload is sent through the HTTP client of ``runner=http``
(``nanovllm.harness.http_client``, streaming, each token's arrival time) and every measured time is read as a
known sequence of engine steps:

- single requests, one at a time, over a grid of prompt lengths L (each repeated; random token ids, distinct per
  request, so a prefix cache finds nothing): the TTFT is one prefill step of L tokens (L up to the server's
  token budget) plus the client-side overhead; the mean inter-token latency after it is a decode step of one
  sequence at context L + its position;
- batched prefills (``--prefill-batches LENxCOUNT,...``): a request of the longest single prompt length is sent,
  and COUNT requests of LEN tokens 30 ms after it, while its prefill runs; they all wait and are admitted
  together in the next step, beside its first decode, so the time from its first token to theirs is one step
  of COUNT x LEN prefill tokens and one decode (what a lone prefill cannot show: how the step cost grows with
  tokens from several prompts, where attention is per prompt, and with a decode mixed in). The server must fit
  them in one step (COUNT x LEN + 1 within its token budget);
- mixed steps (``--mixed-steps NxLENxCOUNT,...``): N requests of 32-token prompts decode together, and 1.5 s
  after them COUNT requests of LEN tokens arrive; the next step prefills those beside the N decodes, so the
  gap in the N outputs that ends with the newcomers' first tokens is one step of COUNT x LEN prefill tokens
  and N decodes (the steps of a loaded server, where a lone prefill or a decode burst alone says nothing of
  what the two cost together). COUNT x LEN + N must fit the server's token budget;
- bursts of N requests of the same lengths sent at once, N over ``--concurrency``, at each of the
  ``--burst-prompt-lens`` (two lengths tell the cost per sequence from the cost per context token at batch N;
  a burst of more than ``--max-burst-tokens`` tokens in all is left out, so it fits the server's KV cache),
  each once per round (``--repeats`` rounds): the mean inter-token latency over the middle of their outputs
  (all N decoding together) is a decode step of N sequences.

These observations are fitted by non-negative least squares (each row weighted by 1 / its measured time, so
short ITLs count as much as long TTFTs) on the ``calibrated`` profile's terms: the per-step intercept (which
here holds the server's whole step cycle: scheduling, the forward pass, output processing; ``step_gap`` is 0),
``num_prefill_tokens``, ``num_decode_seqs``, ``context_tokens`` and ``attn_pairs`` (``num_sampled`` cannot be
told apart from ``num_decode_seqs`` and the client overhead in these observations and stays 0), plus one term no
step has: ``client_overhead``, the constant time a client waits on top of the first token's step (HTTP, the
hops between the server's processes, detokenizing, the event loop). The simulator has no client side, so it does
not add it; ``with_client_overhead`` adds it to simulated records (every token time and the finish time: TTFT and
E2E grow by it, inter-token latencies do not), which is what ``experiments/sim_predicts_vllm.py`` does before
comparing. A server's step is often flat in its row count (prefill tokens + decode sequences) up to a bend and
rises past it (reading the weights dominates a pass over few rows, computing dominates beyond): the fit also
tries ``rows_above_knee`` (``step_time.KNEE_FEATURE``) with its bend at each row count the observations have,
and keeps the bend, or none, with the lowest BIC (``knee_rows`` in the profile; ``--knee-rows`` fixes it, 0
fits none). The profile records every observation with its measured and fitted time, and the fit's residuals.

An unreachable URL, a server that answers with an error or a stream that fails stops the calibration with one
``error:`` line naming the URL and the request (``ServerCalibrationError``).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import httpx
import numpy as np
import yaml
from scipy.optimize import nnls

from nanovllm.harness.http_client import HttpRunnerConfig, serve_over_http
from nanovllm.harness.sim.step_time import CALIBRATION_FEATURES, KNEE_FEATURE
from nanovllm.harness.workload import WorkloadRequest
from nanovllm.serving.records import RequestRecord

# The step terms these observations can tell apart (``num_sampled`` cannot: see the module docstring).
FITTED_FEATURES = ("num_prefill_tokens", "num_decode_seqs", "context_tokens", "attn_pairs")
# Token ids drawn for prompts: ordinary vocabulary entries of every model this targets (no special tokens).
TOKEN_RANGE = (1000, 30000)
# Burst ITLs are read between these output positions from either end: the requests of a burst may be admitted
# a step or two apart, so the first and last few tokens can come from steps with fewer than N decodes.
BURST_EDGE = 4
# The smallest relative error the bend's choice tells apart from none (``_bic``).
RESOLUTION = 1e-4


class ServerCalibrationError(RuntimeError):
    """The server could not be calibrated: unreachable, or a calibration request failed."""


@dataclass(frozen=True)
class CalibrationPlan:
    """The calibration workload. ``url``: the API's base, ending in ``/v1``; ``model``: the name to send (None:
    the server's first). ``prompt_lens``: single-request prompt lengths, each sent ``repeats`` times with
    ``output_len`` tokens; ``concurrency``: burst sizes, each burst of ``burst_prompt_lens``-token prompts with
    ``burst_output_len`` tokens, sent ``repeats`` times (the median of the rounds is fitted), unless it holds
    more than ``max_burst_tokens`` tokens; ``prefill_batches``: (length, count) pairs of batched prefills, each
    behind a request of the longest of ``prompt_lens``, ``repeats`` times (empty: none); ``mixed_steps``:
    (decodes, length, count) triples of mixed steps, ``repeats`` times (empty: none). ``warmup_rounds``:
    untimed rounds of every single request, burst, batched prefill and mixed step first (of the last two, at
    most one): a server's first pass over a batch shape can be far slower than its later ones (vLLM's CPU build's
    kernels prepare themselves per shape), and the held-out workloads meet the shapes warm."""

    url: str
    model: str | None = None
    prompt_lens: tuple[int, ...] = (16, 64, 256, 512, 1024)
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    output_len: int = 32
    burst_prompt_lens: tuple[int, ...] = (32, 512)
    max_burst_tokens: int = 40000
    burst_output_len: int = 48
    prefill_batches: tuple[tuple[int, int], ...] = ((64, 8), (128, 8), (128, 15), (256, 4), (480, 4))
    mixed_steps: tuple[tuple[int, int, int], ...] = ((16, 128, 4), (32, 256, 4), (64, 128, 8))
    repeats: int = 3
    warmup_rounds: int = 1
    seed: int = 0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {self.url!r}")
        for name in ("prompt_lens", "concurrency", "burst_prompt_lens"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
                raise ValueError(f"{name} must be a non-empty list of integers >= 1, got {values!r}")
        if len(set(self.prompt_lens)) < 3:
            raise ValueError(f"prompt_lens needs at least 3 distinct lengths (the prefill cost is quadratic in "
                             f"the length), got {self.prompt_lens!r}")
        if len(set(self.concurrency)) < 2:
            raise ValueError(f"concurrency needs at least 2 distinct burst sizes, got {self.concurrency!r}")
        if self.output_len < 3:
            raise ValueError(f"output_len must be at least 3 (a TTFT and inter-token latencies), got {self.output_len}")
        if self.burst_output_len < 2 * BURST_EDGE + 2:
            raise ValueError(f"burst_output_len must be at least {2 * BURST_EDGE + 2}, got {self.burst_output_len}")
        if not self.bursts():
            raise ValueError(f"max_burst_tokens={self.max_burst_tokens} leaves no burst of concurrency "
                             f"{self.concurrency!r} and burst_prompt_lens {self.burst_prompt_lens!r}")
        for name in ("max_burst_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if any(len(pair) != 2 or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in pair)
               for pair in self.prefill_batches):
            raise ValueError(f"prefill_batches must be (length, count) pairs of integers >= 1, got "
                             f"{self.prefill_batches!r}")
        if any(len(triple) != 3 or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in triple)
               for triple in self.mixed_steps):
            raise ValueError(f"mixed_steps must be (decodes, length, count) triples of integers >= 1, got "
                             f"{self.mixed_steps!r}")
        if not isinstance(self.warmup_rounds, int) or self.warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be an integer >= 0, got {self.warmup_rounds!r}")

    def bursts(self) -> list[tuple[int, int]]:
        """The (prompt length, burst size) pairs sent: every pair within ``max_burst_tokens``."""
        return [(length, batch) for length in self.burst_prompt_lens for batch in self.concurrency
                if batch * (length + self.burst_output_len) <= self.max_burst_tokens]


@dataclass
class Observation:
    """One measured time and the engine steps it spans: ``features`` summed over them (``steps``: how many),
    ``client``: 1 when the time includes the client-side overhead (a TTFT), else 0. Every kind measured is one
    step, whose rows (prefill tokens + decode sequences) the ``rows_above_knee`` term reads."""

    kind: str                # "ttft", "itl", "batched_prefill" or "mixed"
    prompt_len: int
    batch: int
    measured_s: float
    features: dict[str, float]
    steps: float = 1.0
    client: int = 0
    samples: int = 1
    predicted_s: float | None = field(default=None)
    burst: bool = False      # measured on a burst of requests sent at once (else on single requests)
    decodes: int = 0         # a mixed step's decoding requests, and their context then
    decode_context: float = 0.0

    def rows(self) -> int:
        """The rows of the step this observation measures."""
        return int(self.features["num_prefill_tokens"] + self.features["num_decode_seqs"])

    def rows_above(self, knee_rows: int) -> int:
        """``rows_above_knee`` of that step."""
        return max(0, self.rows() - knee_rows)


def prefill_features(prompt_len: int) -> dict[str, float]:
    """The step that computes a whole ``prompt_len``-token prompt of one request (as the engine counts it:
    ``context_tokens`` = cached + new, ``attn_pairs`` = new * cached + new * (new + 1) / 2, nothing cached)."""
    return {"num_prefill_tokens": prompt_len, "num_decode_seqs": 0, "context_tokens": prompt_len,
            "attn_pairs": prompt_len * (prompt_len + 1) / 2}


def batched_prefill_features(length: int, count: int, blocker_len: int) -> dict[str, float]:
    """The step of a batched prefill: ``count`` whole prompts of ``length`` tokens and the first decode of the
    ``blocker_len``-token request they queued behind (a mixed step with one decode)."""
    return mixed_features(length, count, 1, blocker_len + 1)


def mixed_features(length: int, count: int, decodes: int, context: float) -> dict[str, float]:
    """A mixed step: ``count`` whole prompts of ``length`` tokens prefilled beside ``decodes`` decoding requests
    of ``context`` tokens each."""
    prefill, decode = prefill_features(length), decode_features(decodes, context)
    return {name: count * prefill[name] + decode[name] for name in prefill}


def decode_features(batch: int, context: float) -> dict[str, float]:
    """A decode step of ``batch`` sequences, each with ``context`` tokens including the one it computes."""
    return {"num_prefill_tokens": 0, "num_decode_seqs": batch, "context_tokens": batch * context,
            "attn_pairs": batch * context}


def single_itl_context(prompt_len: int, output_len: int) -> float:
    """The mean context of a single request's decode steps: tokens 1 .. output_len-1 come from steps at
    contexts prompt_len+1 .. prompt_len+output_len-1."""
    return prompt_len + output_len / 2


def burst_itl_context(prompt_len: int, burst_output_len: int) -> float:
    """The mean context of a burst's decode steps between output positions ``BURST_EDGE`` and
    ``burst_output_len - 1 - BURST_EDGE``, where its ITL is read."""
    return prompt_len + (BURST_EDGE + 1 + burst_output_len - 1 - BURST_EDGE) / 2


def observations_from_profile(profile: Mapping[str, Any]) -> list[Observation]:
    """The observations a server profile was fitted from, rebuilt from what it records (each one's kind,
    prompt length, batch and measured time, and the calibration's output lengths), so that they can be fitted
    again (another ``knee_rows``) without measuring the server again."""
    plan = profile["calibration"]
    rebuilt = []
    for o in profile["observations"]:
        if o["kind"] == "ttft":
            features, client = prefill_features(o["prompt_len"]), 1
        elif o["kind"] == "mixed":
            features, client = mixed_features(o["prompt_len"], o["batch"], o["decodes"], o["decode_context"]), 0
        elif o["kind"] == "batched_prefill":
            features, client = batched_prefill_features(o["prompt_len"], o["batch"], max(plan["prompt_lens"])), 0
        elif o["burst"]:
            features, client = decode_features(o["batch"], burst_itl_context(o["prompt_len"],
                                                                             plan["burst_output_len"])), 0
        else:
            features, client = decode_features(1, single_itl_context(o["prompt_len"], plan["output_len"])), 0
        rebuilt.append(Observation(o["kind"], o["prompt_len"], o["batch"], o["measured_s"], features, client=client,
                                   samples=o["samples"], burst=o["burst"], decodes=o.get("decodes", 0),
                                   decode_context=o.get("decode_context", 0.0)))
    return rebuilt


def _window_itl(record: RequestRecord, first: int, last: int) -> float:
    """Mean seconds per token between output positions ``first`` and ``last`` (0-based), robust to a stream
    that delivers several tokens in one chunk (their shared arrival time)."""
    times = record["token_times"]
    return (times[last] - times[first]) / (last - first)


def _prompt(rng: np.random.Generator, length: int) -> list[int]:
    return [int(t) for t in rng.integers(*TOKEN_RANGE, length)]


def _request(rng: np.random.Generator, length: int, output_len: int, request_id: str) -> WorkloadRequest:
    """One calibration request: a fresh random prompt of ``length`` tokens, exactly ``output_len`` tokens back."""
    return WorkloadRequest(0.0, _prompt(rng, length), output_len, ignore_eos=True, request_id=request_id)


def _burst(plan: CalibrationPlan, rng: np.random.Generator, length: int, batch: int,
           name: str) -> list[WorkloadRequest]:
    """``batch`` requests of ``length``-token prompts, sent at once (``name``-0, ``name``-1, ...)."""
    return [_request(rng, length, plan.burst_output_len, f"{name}-{i}") for i in range(batch)]


def _send(plan: CalibrationPlan, requests: Sequence[WorkloadRequest], max_concurrency: int | None,
          what: str) -> list[RequestRecord]:
    """Serve ``requests`` over HTTP; every one must come back complete, else ``ServerCalibrationError``."""
    config = HttpRunnerConfig(url=plan.url, model=plan.model, max_concurrency=max_concurrency,
                              timeout_s=plan.timeout_s)
    try:
        result = serve_over_http(config, requests)
    except ValueError as exc:   # the client's own: the server is unreachable or /models failed
        raise ServerCalibrationError(str(exc)) from None
    by_id = {r["request_id"]: r for r in result.requests}
    for w in requests:
        record = by_id.get(str(w.request_id))
        if record is None or record["error"] is not None:
            error = "no record" if record is None else record["error"]
            raise ServerCalibrationError(f"url={plan.url}: calibration request {w.request_id} ({what}) failed: {error}")
        if record["num_output_tokens"] != w.max_tokens or len(record["token_times"]) != w.max_tokens:
            raise ServerCalibrationError(
                f"url={plan.url}: calibration request {w.request_id} ({what}) streamed "
                f"{len(record['token_times'])} token times for {record['num_output_tokens']} tokens, expected "
                f"{w.max_tokens} (the server must honour max_tokens with ignore_eos and stream usage per chunk)")
    return [by_id[str(w.request_id)] for w in requests]


def check_reachable(url: str, timeout_s: float = 10.0) -> None:
    """``ServerCalibrationError`` naming ``url`` unless ``GET {url}/models`` answers 200."""
    try:
        response = httpx.get(f"{url.rstrip('/')}/models", timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ServerCalibrationError(f"url={url}: cannot reach the server ({type(exc).__name__}: {exc})") from None
    if response.status_code != 200:
        raise ServerCalibrationError(f"url={url}: GET /models answered HTTP {response.status_code}: "
                                     f"{response.text[:300]}")


def measure(plan: CalibrationPlan, progress: bool = True) -> list[Observation]:
    """Run the calibration workload against ``plan.url`` and return its observations: per prompt length the
    median TTFT and the median of the requests' mean ITL, per burst size the median mean ITL of the middle of
    the outputs. A warm-up request goes first, then ``plan.warmup_rounds`` rounds of every shape (untimed)."""
    check_reachable(plan.url)
    rng = np.random.default_rng(plan.seed)
    _send(plan, [_request(rng, max(plan.prompt_lens), plan.output_len, "warmup")], 1, "warm-up")
    for r in range(plan.warmup_rounds):
        _send(plan, [_request(rng, length, plan.output_len, f"warmup-{r}-{length}") for length in plan.prompt_lens],
              1, "warm-up single requests")
        for length, batch in plan.bursts():
            _send(plan, _burst(plan, rng, length, batch, f"warmup-burst{batch}x{length}-{r}"), None,
                  f"warm-up burst of {batch} x {length} tokens")
    # One at a time (max_concurrency 1), the lengths interleaved so a slow spell of the machine hits them all.
    singles = [_request(rng, length, plan.output_len, f"single-{r}-{length}")
               for r in range(plan.repeats) for length in plan.prompt_lens]
    records = _send(plan, singles, 1, "single requests")
    observations = []
    for length in plan.prompt_lens:
        mine = [rec for w, rec in zip(singles, records) if len(w.prompt) == length]
        # ``_send`` checked that every token came back, so each first token has a time.
        ttfts = [float(rec["first_token_time"] or 0.0) - rec["arrival_time"] for rec in mine]
        itls = [_window_itl(rec, 0, plan.output_len - 1) for rec in mine]
        observations.append(Observation("ttft", length, 1, statistics.median(ttfts), prefill_features(length),
                                        client=1, samples=len(ttfts)))
        # Tokens 1 .. output_len-1 come from decode steps at contexts length+1 .. length+output_len-1.
        observations.append(Observation("itl", length, 1, statistics.median(itls),
                                        decode_features(1, single_itl_context(length, plan.output_len)),
                                        samples=len(itls)))
        if progress:
            print(f"  prompt {length:5d}: TTFT {observations[-2].measured_s * 1e3:8.1f} ms, "
                  f"ITL {observations[-1].measured_s * 1e3:7.1f} ms", file=sys.stderr, flush=True)
    observations += _batched_prefills(plan, rng, progress)
    first, last = BURST_EDGE, plan.burst_output_len - 1 - BURST_EDGE
    bursts: dict[tuple[int, int], list[float]] = {pair: [] for pair in plan.bursts()}
    for r in range(plan.repeats):   # each burst once per round, so a slow spell of the machine hits them all
        for length, batch in bursts:
            records = _send(plan, _burst(plan, rng, length, batch, f"burst{batch}x{length}-{r}"), None,
                            f"burst of {batch} x {length} tokens")
            bursts[length, batch].append(statistics.median(_window_itl(rec, first, last) for rec in records))
    for (length, batch), itls in bursts.items():
        observations.append(Observation("itl", length, batch, statistics.median(itls),
                                        decode_features(batch, burst_itl_context(length, plan.burst_output_len)),
                                        samples=len(itls), burst=True))
        if progress:
            print(f"  burst {batch:4d} x {length:4d}: ITL {observations[-1].measured_s * 1e3:7.1f} ms "
                  f"(rounds: {', '.join(f'{x * 1e3:.1f}' for x in itls)})", file=sys.stderr, flush=True)
    single_itl = min(o.measured_s for o in observations if o.kind == "itl" and not o.burst)
    return observations + _mixed_steps(plan, rng, single_itl, progress)


# Mixed steps: the decoding requests' prompts, and when the prompts to prefill beside them arrive (after the
# decoders' own prefill); the decoders' outputs last at least twice that at the server's single-request ITL.
MIXED_DECODE_PROMPT = 32
MIXED_INJECT_S = 1.5
MIXED_MAX_OUTPUT = 448


def _mixed_step(plan: CalibrationPlan, decoders: Sequence[RequestRecord], newcomers: Sequence[RequestRecord],
                what: str) -> tuple[float, float]:
    """The mixed step's duration and its decoders' mean context: per decoder, the gap in its output that ends
    with the token arriving with the newcomers' (median) first token; the median over the decoders."""
    arrival = statistics.median(float(rec["first_token_time"] or 0.0) for rec in newcomers)
    gaps, contexts = [], []
    for rec in decoders:
        times = [float(t) for t in rec["token_times"]]
        k = min(range(1, len(times)), key=lambda i: abs(times[i] - arrival))
        gap = times[k] - times[k - 1]
        if abs(times[k] - arrival) > 0.5 * gap:   # no output step of this decoder ended with the newcomers'
            raise ServerCalibrationError(
                f"url={plan.url}: the {what} did not run in one step with the decoding requests (the newcomers' "
                f"first tokens came {abs(times[k] - arrival) * 1e3:.1f} ms from the nearest decode token, whose "
                f"step lasted {gap * 1e3:.1f} ms): the decoders had ended or the step did not fit the server's "
                "token budget or sequence cap; give smaller mixed_steps or none")
        gaps.append(gap)
        contexts.append(MIXED_DECODE_PROMPT + k + 1)   # the prompt, k tokens out, and the one it computes
    return statistics.median(gaps), statistics.fmean(contexts)


def _mixed_steps(plan: CalibrationPlan, rng: np.random.Generator, single_itl: float,
                 progress: bool) -> list[Observation]:
    """The ``mixed_steps`` observations (module docstring), the median over ``repeats`` rounds; a warm-up round
    first when ``plan.warmup_rounds``. ``single_itl``: the server's fastest measured decode step, which sets
    how many tokens the decoders ask for so that they still decode when the newcomers arrive."""
    output = min(MIXED_MAX_OUTPUT, max(2 * BURST_EDGE + 2, int(np.ceil(2 * MIXED_INJECT_S / single_itl))))
    steps: dict[tuple[int, int, int], list[tuple[float, float]]] = {triple: [] for triple in plan.mixed_steps}
    for r in range(min(plan.warmup_rounds, 1) + plan.repeats):
        for decodes, length, count in plan.mixed_steps:
            name = f"mixed{decodes}+{count}x{length}-{r}"
            decoders = [WorkloadRequest(0.0, _prompt(rng, MIXED_DECODE_PROMPT), output, ignore_eos=True,
                                        request_id=f"{name}-d{i}") for i in range(decodes)]
            newcomers = [WorkloadRequest(MIXED_INJECT_S, _prompt(rng, length), 2, ignore_eos=True,
                                         request_id=f"{name}-n{i}") for i in range(count)]
            what = f"mixed step of {count} x {length} prefill tokens and {decodes} decodes"
            records = _send(plan, decoders + newcomers, None, what)
            measured = _mixed_step(plan, records[:decodes], records[decodes:], what)
            if r >= min(plan.warmup_rounds, 1):
                steps[decodes, length, count].append(measured)
    observations = []
    for (decodes, length, count), measured in steps.items():
        step = statistics.median(m[0] for m in measured)
        context = statistics.fmean(m[1] for m in measured)
        observations.append(Observation("mixed", length, count, step, mixed_features(length, count, decodes, context),
                                        samples=len(measured), decodes=decodes, decode_context=context))
        if progress:
            print(f"  mixed {decodes:3d} decodes + {count:3d} x {length:4d}: step {step * 1e3:7.1f} ms "
                  f"(rounds: {', '.join(f'{m[0] * 1e3:.1f}' for m in measured)})", file=sys.stderr, flush=True)
    return observations


def _solve(observations: Sequence[Observation], knee_rows: int | None) -> tuple[np.ndarray, np.ndarray]:
    """NNLS on rows scaled by 1 / measured time: the solution (intercept, client overhead, ``FITTED_FEATURES``,
    then ``rows_above_knee`` when ``knee_rows`` is given) and the design matrix."""
    design = np.array([[o.steps, float(o.client), *(o.features[f] for f in FITTED_FEATURES),
                        *(() if knee_rows is None else (o.rows_above(knee_rows),))] for o in observations])
    measured = np.array([o.measured_s for o in observations])
    weighted = design / measured[:, None]
    scale = np.abs(weighted).max(axis=0)
    scale[scale == 0] = 1.0
    solution, _ = nnls(weighted / scale, np.ones(len(observations)))
    return solution / scale, design


def _bic(observations: Sequence[Observation], knee_rows: int | None) -> float:
    """The Bayesian information criterion of the relative-error fit with this bend (None: none): a bend is a
    parameter too, so it is kept only where it pays for itself."""
    x, design = _solve(observations, knee_rows)
    measured = np.array([o.measured_s for o in observations])
    relative = (design @ x - measured) / measured
    n = len(observations)
    parameters = int(np.count_nonzero(x)) + (knee_rows is not None)
    # Relative errors below RESOLUTION are not told apart (no clock measures a server's step that finely), so
    # two fits that both reach it count as equally good and the one with fewer parameters wins.
    mean_square = max(float(np.sum(relative ** 2)) / n, RESOLUTION ** 2)
    return n * float(np.log(mean_square)) + parameters * float(np.log(n))


def fitted_knee(observations: Sequence[Observation]) -> int | None:
    """The bend (``knee_rows``) with the lowest BIC among the row counts the observations' steps have (below
    their largest, where the term would be 0 everywhere), or None where no bend beats the straight fit."""
    candidates = sorted({o.rows() for o in observations})[:-1]
    return min([None, *candidates], key=lambda knee: _bic(observations, knee))


# The batched prompts are sent this long after the request they queue behind: enough for the server to have
# admitted it and started its prefill step, far less than that step lasts.
BATCH_LEAD_S = 0.03


def _batched_prefills(plan: CalibrationPlan, rng: np.random.Generator, progress: bool) -> list[Observation]:
    """The ``prefill_batches`` observations: per (length, count) the median over ``repeats`` rounds of the time
    from the leading request's first token to the median first token of the batch (module docstring). A
    warm-up round first when ``plan.warmup_rounds``."""
    blocker_len = max(plan.prompt_lens)
    steps: dict[tuple[int, int], list[float]] = {pair: [] for pair in plan.prefill_batches}
    for r in range(min(plan.warmup_rounds, 1) + plan.repeats):
        for length, count in plan.prefill_batches:
            name = f"prefill-batch{count}x{length}-{r}"
            requests = [WorkloadRequest(0.0, _prompt(rng, blocker_len), 2, ignore_eos=True,
                                        request_id=f"{name}-lead"),
                        *(WorkloadRequest(BATCH_LEAD_S, _prompt(rng, length), 2, ignore_eos=True,
                                          request_id=f"{name}-{i}") for i in range(count))]
            what = f"batched prefill of {count} x {length} tokens"
            records = _send(plan, requests, None, what)
            lead_first, lead_second = (float(t) for t in records[0]["token_times"][:2])
            batch_first = statistics.median(float(rec["first_token_time"] or 0.0) for rec in records[1:])
            # The batch's first tokens come from the step of the leader's second token, or it was not one step.
            if abs(batch_first - lead_second) > 0.5 * abs(batch_first - lead_first):
                raise ServerCalibrationError(
                    f"url={plan.url}: the {what} did not run in one step beside the first decode of the "
                    f"{blocker_len}-token request sent {BATCH_LEAD_S * 1e3:.0f} ms before it (its first tokens "
                    f"came {(batch_first - lead_first) * 1e3:.1f} ms after that request's first, its second "
                    f"{(lead_second - lead_first) * 1e3:.1f} ms after): the server's token budget or sequence cap "
                    f"is below {count * length + 1} tokens / {count + 1} sequences, or its {blocker_len}-token "
                    "prefill ends before the batch arrives; give smaller prefill_batches, a longer prompt_lens "
                    "maximum, or none")
            if r >= min(plan.warmup_rounds, 1):
                steps[length, count].append(batch_first - lead_first)
    observations = []
    for (length, count), times in steps.items():
        step = statistics.median(times)
        observations.append(Observation("batched_prefill", length, count, step,
                                        batched_prefill_features(length, count, blocker_len), samples=len(times)))
        if progress:
            print(f"  prefill batch {count:3d} x {length:4d}: step {step * 1e3:7.1f} ms "
                  f"(rounds: {', '.join(f'{x * 1e3:.1f}' for x in times)})", file=sys.stderr, flush=True)
    return observations


def fit(observations: Sequence[Observation], knee_rows: int | None | str = "fit") -> dict[str, Any]:
    """The profile's fitted part: ``intercept``, ``coefficients`` (over ``CALIBRATION_FEATURES``, the unfitted
    ones 0, plus ``rows_above_knee`` with a bend), ``knee_rows`` (None: no bend), ``client_overhead``, the fit's
    quality, and each observation with its fitted time. NNLS on rows scaled by 1 / measured time (relative
    error). ``knee_rows``: "fit" (``fitted_knee``), a row count, or None or 0 for no bend."""
    if len(observations) < len(FITTED_FEATURES) + 2:
        raise ValueError(f"calibration needs at least {len(FITTED_FEATURES) + 2} observations, got {len(observations)}")
    if any(o.measured_s <= 0 for o in observations):
        raise ValueError("calibration: a measured time is not positive")
    knee = fitted_knee(observations) if knee_rows == "fit" else (int(knee_rows) if knee_rows else None)
    x, design = _solve(observations, knee)
    measured = np.array([o.measured_s for o in observations])
    predicted = design @ x
    residual = predicted - measured
    relative = np.abs(residual) / measured
    total = float(np.sum((measured - measured.mean()) ** 2)) or 1.0
    coefficients = {name: 0.0 for name in CALIBRATION_FEATURES}
    coefficients.update({name: float(v) for name, v in zip(FITTED_FEATURES, x[2:])})
    if knee is not None:
        coefficients[KNEE_FEATURE] = float(x[-1])
    return {
        "intercept": float(x[0]),
        "client_overhead": float(x[1]),
        "coefficients": coefficients,
        "knee_rows": knee,
        "fit": {"r2": 1.0 - float(np.sum(residual ** 2)) / total,
                "median_abs_rel_error": float(np.median(relative)),
                "max_abs_rel_error": float(relative.max()),
                "max_abs_residual_s": float(np.abs(residual).max())},
        "observations": [{"kind": o.kind, "prompt_len": o.prompt_len, "batch": o.batch, "samples": o.samples,
                          "burst": o.burst, **({"decodes": o.decodes, "decode_context": o.decode_context}
                                               if o.kind == "mixed" else {}),
                          "measured_s": float(m), "fitted_s": float(p)}
                         for o, m, p in zip(observations, measured, predicted)],
        "feature_range": {name: [float(design[:, j + 2].min()), float(design[:, j + 2].max())]
                          for j, name in enumerate(FITTED_FEATURES)},
    }


def calibrate_server(plan: CalibrationPlan, out: str | Path | None = None, *, dtype: str | None = None,
                     command: str | None = None, progress: bool = True,
                     knee_rows: int | None | str = "fit") -> dict[str, Any]:
    """Measure ``plan`` against its server, fit, and write the profile to ``out`` (None: not written); returns
    the profile. ``dtype``: the model dtype the server runs, recorded so that a simulated run in another dtype
    is refused (``CalibratedStepTime``); None records none. ``knee_rows``: as ``fit`` takes it."""
    started = time.time()
    observations = measure(plan, progress=progress)
    fitted = fit(observations, knee_rows)
    profile: dict[str, Any] = {
        "step_time": "calibrated",
        "source": "server",
        "url": plan.url,
        **({"dtype": dtype} if dtype else {}),
        "num_observations": len(observations),
        "step_gap": 0.0,   # the intercept is the whole step cycle as a client sees it
        **fitted,
        "calibration": {"prompt_lens": list(plan.prompt_lens), "concurrency": list(plan.concurrency),
                        "output_len": plan.output_len, "burst_prompt_lens": list(plan.burst_prompt_lens),
                        "prefill_batches": [list(pair) for pair in plan.prefill_batches],
                        "mixed_steps": [list(triple) for triple in plan.mixed_steps],
                        "max_burst_tokens": plan.max_burst_tokens,
                        "burst_output_len": plan.burst_output_len, "repeats": plan.repeats,
                        "warmup_rounds": plan.warmup_rounds, "seed": plan.seed,
                        "seconds": round(time.time() - started, 1)},
        **({"command": command} if command else {}),
    }
    if out is not None:
        Path(out).write_text(yaml.safe_dump(profile, sort_keys=False), encoding="utf-8")
    return profile


def refit(profile: Mapping[str, Any], knee_rows: int | None | str = "fit") -> dict[str, Any]:
    """``profile`` fitted again from its own observations (``observations_from_profile``) with ``knee_rows`` (as
    ``fit`` takes it): the same measurements, another choice of terms."""
    return {**profile, **fit(observations_from_profile(profile), knee_rows)}


def client_overhead(profile: Mapping[str, Any] | str | Path) -> float:
    """The profile's ``client_overhead`` in seconds (0 for a profile fitted from an engine's own steps)."""
    data = profile if isinstance(profile, Mapping) else yaml.safe_load(Path(profile).read_text(encoding="utf-8"))
    return float(data.get("client_overhead") or 0.0)


def with_client_overhead(records: Sequence[RequestRecord], seconds: float) -> list[RequestRecord]:
    """Simulated records as a client would see them: each token time, the first token's and the finish time
    ``seconds`` later (TTFT and E2E grow by it; inter-token latencies and TPOT do not). Failed requests that
    produced nothing keep their times."""
    shifted = []
    for record in records:
        new = dict(record)
        new["token_times"] = [t + seconds for t in record["token_times"]]
        if record["first_token_time"] is not None:
            new["first_token_time"] = record["first_token_time"] + seconds
        if record["finish_time"] is not None and record["token_times"]:
            new["finish_time"] = record["finish_time"] + seconds
        shifted.append(new)  # type: ignore[arg-type]
    return shifted  # type: ignore[return-value]


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _tuples(text: str, size: int, example: str) -> list[tuple[int, ...]]:
    try:
        parts = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected values such as {example}, got {text!r}") from None
    if any(len(part) != size for part in parts):
        raise argparse.ArgumentTypeError(f"expected values such as {example}, got {text!r}")
    return parts


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    return tuple((a, b) for a, b in _tuples(text, 2, "128x8,256x4 (LENxCOUNT)"))


def _triples(text: str) -> tuple[tuple[int, int, int], ...]:
    return tuple((a, b, c) for a, b, c in _tuples(text, 3, "16x128x4,32x256x4 (NxLENxCOUNT)"))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the API's base, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="the model name to send (default: the server's first)")
    parser.add_argument("--out", required=True, help="the profile YAML to write")
    parser.add_argument("--dtype", default=None, help="the model dtype the server runs (recorded in the profile)")
    defaults = CalibrationPlan(url="http://x")
    parser.add_argument("--prompt-lens", type=_ints, default=defaults.prompt_lens)
    parser.add_argument("--concurrency", type=_ints, default=defaults.concurrency)
    parser.add_argument("--output-len", type=int, default=defaults.output_len)
    parser.add_argument("--burst-prompt-lens", type=_ints, default=defaults.burst_prompt_lens)
    parser.add_argument("--mixed-steps", type=_triples, default=defaults.mixed_steps,
                        help="NxLENxCOUNT,...: mixed steps of COUNT prompts of LEN tokens beside N decodes "
                             "('' for none)")
    parser.add_argument("--prefill-batches", type=_pairs, default=defaults.prefill_batches,
                        help="LENxCOUNT,...: batched prefills of COUNT prompts of LEN tokens ('' for none)")
    parser.add_argument("--max-burst-tokens", type=int, default=defaults.max_burst_tokens)
    parser.add_argument("--burst-output-len", type=int, default=defaults.burst_output_len)
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--warmup-rounds", type=int, default=defaults.warmup_rounds)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--knee-rows", type=int, default=None,
                        help="the row count where the step cost bends (default: fitted; 0: no bend)")
    args = parser.parse_args(argv)
    if args.knee_rows is not None and args.knee_rows < 0:
        parser.error(f"--knee-rows must be >= 0, got {args.knee_rows}")
    url = args.url.rstrip("/")
    if not url.endswith("/v1"):
        url += "/v1"
    try:
        plan = CalibrationPlan(url=url, model=args.model, prompt_lens=args.prompt_lens, concurrency=args.concurrency,
                               output_len=args.output_len, burst_prompt_lens=args.burst_prompt_lens,
                               prefill_batches=args.prefill_batches, mixed_steps=args.mixed_steps,
                               max_burst_tokens=args.max_burst_tokens,
                               burst_output_len=args.burst_output_len, repeats=args.repeats,
                               warmup_rounds=args.warmup_rounds, seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    command = "python -m nanovllm.harness.sim.calibrate_server " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        profile = calibrate_server(plan, args.out, dtype=args.dtype, command=command,
                                   knee_rows="fit" if args.knee_rows is None else args.knee_rows)
    except ServerCalibrationError as exc:
        raise SystemExit(f"error: {exc}") from None
    fit_ = profile["fit"]
    print(f"wrote {args.out}: client overhead {profile['client_overhead'] * 1e3:.1f} ms, intercept "
          f"{profile['intercept'] * 1e3:.2f} ms/step, median |error| {fit_['median_abs_rel_error']:.1%}, "
          f"max {fit_['max_abs_rel_error']:.1%}")


__all__ = ["CalibrationPlan", "Observation", "ServerCalibrationError", "batched_prefill_features",
           "calibrate_server", "check_reachable", "client_overhead", "decode_features", "fit", "fitted_knee", "measure",
           "mixed_features", "observations_from_profile", "prefill_features", "refit", "with_client_overhead"]

if __name__ == "__main__":
    main()
