"""Calibrate the simulator to whatever serves an OpenAI-compatible API, from what a client sees::

    python -m nanovllm.harness.sim.calibrate_server --url http://127.0.0.1:8000/v1 --out profile.yaml
        [--model NAME] [--dtype bfloat16] [--prompt-lens 16,64,256,512,1024] [--concurrency 1,2,4,8,16,32,64,128]
        [--output-len 32] [--burst-output-len 48] [--burst-prompt-lens 32,512] [--max-burst-tokens 40000]
        [--repeats 3]

then ``python -m nanovllm.run runner=sim runner.step_time=calibrated runner.profile=profile.yaml``. No step
timings are needed from the server: the calibration workload is sent through the HTTP client of ``runner=http``
(``nanovllm.harness.http_client``, streaming, each token's arrival time) and every measured time is read as a
known sequence of engine steps:

- single requests, one at a time, over a grid of prompt lengths L (each repeated; random token ids, distinct per
  request, so a prefix cache finds nothing): the TTFT is one prefill step of L tokens (L up to the server's
  token budget) plus the client-side overhead; the mean inter-token latency after it is a decode step of one
  sequence at context L + its position;
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
comparing. The profile records every observation with its measured and fitted time, and the fit's residuals.

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
from nanovllm.harness.sim.step_time import CALIBRATION_FEATURES
from nanovllm.harness.workload import WorkloadRequest
from nanovllm.serving.records import RequestRecord

# The step terms these observations can tell apart (``num_sampled`` cannot: see the module docstring).
FITTED_FEATURES = ("num_prefill_tokens", "num_decode_seqs", "context_tokens", "attn_pairs")
# Token ids drawn for prompts: ordinary vocabulary entries of every model this targets (no special tokens).
TOKEN_RANGE = (1000, 30000)
# Burst ITLs are read between these output positions from either end: the requests of a burst may be admitted
# a step or two apart, so the first and last few tokens can come from steps with fewer than N decodes.
BURST_EDGE = 4


class ServerCalibrationError(RuntimeError):
    """The server could not be calibrated: unreachable, or a calibration request failed."""


@dataclass(frozen=True)
class CalibrationPlan:
    """The calibration workload. ``url``: the API's base, ending in ``/v1``; ``model``: the name to send (None:
    the server's first). ``prompt_lens``: single-request prompt lengths, each sent ``repeats`` times with
    ``output_len`` tokens; ``concurrency``: burst sizes, each burst of ``burst_prompt_lens``-token prompts with
    ``burst_output_len`` tokens, sent ``repeats`` times (the median of the rounds is fitted), unless it holds
    more than ``max_burst_tokens`` tokens. ``warmup_rounds``: untimed rounds of every single request and burst
    first: a server's first pass over a batch shape can be far slower than its later ones (vLLM's CPU build's
    kernels prepare themselves per shape), and the held-out workloads meet the shapes warm."""

    url: str
    model: str | None = None
    prompt_lens: tuple[int, ...] = (16, 64, 256, 512, 1024)
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    output_len: int = 32
    burst_prompt_lens: tuple[int, ...] = (32, 512)
    max_burst_tokens: int = 40000
    burst_output_len: int = 48
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
        if not isinstance(self.warmup_rounds, int) or self.warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be an integer >= 0, got {self.warmup_rounds!r}")

    def bursts(self) -> list[tuple[int, int]]:
        """The (prompt length, burst size) pairs sent: every pair within ``max_burst_tokens``."""
        return [(length, batch) for length in self.burst_prompt_lens for batch in self.concurrency
                if batch * (length + self.burst_output_len) <= self.max_burst_tokens]


@dataclass
class Observation:
    """One measured time and the engine steps it spans: ``features`` summed over them (``steps``: how many),
    ``client``: 1 when the time includes the client-side overhead (a TTFT), else 0."""

    kind: str                # "ttft" or "itl"
    prompt_len: int
    batch: int
    measured_s: float
    features: dict[str, float]
    steps: float = 1.0
    client: int = 0
    samples: int = 1
    predicted_s: float | None = field(default=None)


def prefill_features(prompt_len: int) -> dict[str, float]:
    """The step that computes a whole ``prompt_len``-token prompt of one request (as the engine counts it:
    ``context_tokens`` = cached + new, ``attn_pairs`` = new * cached + new * (new + 1) / 2, nothing cached)."""
    return {"num_prefill_tokens": prompt_len, "num_decode_seqs": 0, "context_tokens": prompt_len,
            "attn_pairs": prompt_len * (prompt_len + 1) / 2}


def decode_features(batch: int, context: float) -> dict[str, float]:
    """A decode step of ``batch`` sequences, each with ``context`` tokens including the one it computes."""
    return {"num_prefill_tokens": 0, "num_decode_seqs": batch, "context_tokens": batch * context,
            "attn_pairs": batch * context}


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


def _burst(plan: CalibrationPlan, rng: np.random.Generator, length: int, batch: int, name: str) -> list[WorkloadRequest]:
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
                                        decode_features(1, length + plan.output_len / 2), samples=len(itls)))
        if progress:
            print(f"  prompt {length:5d}: TTFT {observations[-2].measured_s * 1e3:8.1f} ms, "
                  f"ITL {observations[-1].measured_s * 1e3:7.1f} ms", file=sys.stderr, flush=True)
    first, last = BURST_EDGE, plan.burst_output_len - 1 - BURST_EDGE
    bursts: dict[tuple[int, int], list[float]] = {pair: [] for pair in plan.bursts()}
    for r in range(plan.repeats):   # each burst once per round, so a slow spell of the machine hits them all
        for length, batch in bursts:
            records = _send(plan, _burst(plan, rng, length, batch, f"burst{batch}x{length}-{r}"), None,
                            f"burst of {batch} x {length} tokens")
            bursts[length, batch].append(statistics.median(_window_itl(rec, first, last) for rec in records))
    for (length, batch), itls in bursts.items():
        context = length + (first + 1 + last) / 2
        observations.append(Observation("itl", length, batch, statistics.median(itls),
                                        decode_features(batch, context), samples=len(itls)))
        if progress:
            print(f"  burst {batch:4d} x {length:4d}: ITL {observations[-1].measured_s * 1e3:7.1f} ms "
                  f"(rounds: {', '.join(f'{x * 1e3:.1f}' for x in itls)})", file=sys.stderr, flush=True)
    return observations


def fit(observations: Sequence[Observation]) -> dict[str, Any]:
    """The profile's fitted part: ``intercept``, ``coefficients`` (over ``CALIBRATION_FEATURES``, the unfitted
    ones 0), ``client_overhead``, the fit's quality, and each observation with its fitted time. NNLS on rows
    scaled by 1 / measured time (relative error)."""
    if len(observations) < len(FITTED_FEATURES) + 2:
        raise ValueError(f"calibration needs at least {len(FITTED_FEATURES) + 2} observations, got {len(observations)}")
    design = np.array([[o.steps, float(o.client), *(o.features[f] for f in FITTED_FEATURES)] for o in observations])
    measured = np.array([o.measured_s for o in observations])
    if np.any(measured <= 0):
        raise ValueError("calibration: a measured time is not positive")
    weighted = design / measured[:, None]
    scale = np.abs(weighted).max(axis=0)
    scale[scale == 0] = 1.0
    solution, _ = nnls(weighted / scale, np.ones(len(observations)))
    x = solution / scale
    predicted = design @ x
    residual = predicted - measured
    relative = np.abs(residual) / measured
    total = float(np.sum((measured - measured.mean()) ** 2)) or 1.0
    coefficients = {name: 0.0 for name in CALIBRATION_FEATURES}
    coefficients.update({name: float(v) for name, v in zip(FITTED_FEATURES, x[2:])})
    return {
        "intercept": float(x[0]),
        "client_overhead": float(x[1]),
        "coefficients": coefficients,
        "fit": {"r2": 1.0 - float(np.sum(residual ** 2)) / total,
                "median_abs_rel_error": float(np.median(relative)),
                "max_abs_rel_error": float(relative.max()),
                "max_abs_residual_s": float(np.abs(residual).max())},
        "observations": [{"kind": o.kind, "prompt_len": o.prompt_len, "batch": o.batch, "samples": o.samples,
                          "measured_s": float(m), "fitted_s": float(p)}
                         for o, m, p in zip(observations, measured, predicted)],
        "feature_range": {name: [float(design[:, j + 2].min()), float(design[:, j + 2].max())]
                          for j, name in enumerate(FITTED_FEATURES)},
    }


def calibrate_server(plan: CalibrationPlan, out: str | Path | None = None, *, dtype: str | None = None,
                     command: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Measure ``plan`` against its server, fit, and write the profile to ``out`` (None: not written); returns
    the profile. ``dtype``: the model dtype the server runs, recorded so that a simulated run in another dtype
    is refused (``CalibratedStepTime``); None records none."""
    started = time.time()
    observations = measure(plan, progress=progress)
    fitted = fit(observations)
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
                        "max_burst_tokens": plan.max_burst_tokens,
                        "burst_output_len": plan.burst_output_len, "repeats": plan.repeats,
                        "warmup_rounds": plan.warmup_rounds, "seed": plan.seed,
                        "seconds": round(time.time() - started, 1)},
        **({"command": command} if command else {}),
    }
    if out is not None:
        Path(out).write_text(yaml.safe_dump(profile, sort_keys=False), encoding="utf-8")
    return profile


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
    parser.add_argument("--max-burst-tokens", type=int, default=defaults.max_burst_tokens)
    parser.add_argument("--burst-output-len", type=int, default=defaults.burst_output_len)
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--warmup-rounds", type=int, default=defaults.warmup_rounds)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    url = args.url.rstrip("/")
    if not url.endswith("/v1"):
        url += "/v1"
    try:
        plan = CalibrationPlan(url=url, model=args.model, prompt_lens=args.prompt_lens, concurrency=args.concurrency,
                               output_len=args.output_len, burst_prompt_lens=args.burst_prompt_lens,
                               max_burst_tokens=args.max_burst_tokens,
                               burst_output_len=args.burst_output_len, repeats=args.repeats,
                               warmup_rounds=args.warmup_rounds, seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    command = "python -m nanovllm.harness.sim.calibrate_server " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        profile = calibrate_server(plan, args.out, dtype=args.dtype, command=command)
    except ServerCalibrationError as exc:
        raise SystemExit(f"error: {exc}") from None
    fit_ = profile["fit"]
    print(f"wrote {args.out}: client overhead {profile['client_overhead'] * 1e3:.1f} ms, intercept "
          f"{profile['intercept'] * 1e3:.2f} ms/step, median |error| {fit_['median_abs_rel_error']:.1%}, "
          f"max {fit_['max_abs_rel_error']:.1%}")


__all__ = ["CalibrationPlan", "Observation", "ServerCalibrationError", "calibrate_server", "check_reachable",
           "client_overhead", "decode_features", "fit", "measure", "prefill_features", "with_client_overhead"]

if __name__ == "__main__":
    main()
