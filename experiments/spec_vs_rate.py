"""Speculative decoding across request rates: no speculation, ``fixed`` K, ``off_above_batch`` and ``adaptive``
(issue #58's study), on a copy workload where the n-gram proposer pays, with Poisson arrivals::

    python experiments/spec_vs_rate.py                       # the real engine, in this process
    python experiments/spec_vs_rate.py --part vllm           # vLLM's CPU build (~/vllm-venv), none vs ngram
    python experiments/spec_vs_rate.py --part sim --rates 1,2,4,8,16 --num-requests 64   # runner=sim, beyond

``real``: one engine per configuration, all loaded in this process; at each rate every configuration serves the
same requests (same prompts, same arrival times), configurations taking turns (the first one rotates per rate),
so each has the others beside it in the same spell of the shared machine. ``vllm``: vLLM's OpenAI server
(``python -m vllm.entrypoints.openai.api_server``, 127.0.0.1, pinned to ``--vllm-core``), once without
speculation and once with ``--speculative-config`` ngram at the same K, sent the same token ids at the same
times by nano-vllm's HTTP client (``harness.http_client.serve_over_http``; TPOT measured where a client sees
it). ``sim``: the same configurations and requests through ``python -m nanovllm.run runner=sim`` (a trace of
the requests), for rates the real engine cannot reach on this machine; it needs a simulator that prices
speculation, and says so when the simulator refuses it.

Each part writes ``OUT/<part>.json``; the table printed at the end holds every part found in ``OUT``:
throughput (output tokens/s), p50/p99 TPOT, acceptance rate and mean accepted length per rate and config.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from nanovllm.harness.workload import WorkloadRequest
from nanovllm.harness.workload.distributions import sample_arrival_times
from vllm_server import stop_vllm, wait_up

FRUITS = ("apple", "banana", "cherry", "date", "elderberry", "fig", "grape", "honeydew", "kiwi", "lemon", "mango",
          "nectarine", "orange", "papaya", "quince", "raspberry", "strawberry", "tangerine")
OPS = (("add", "+"), ("sub", "-"), ("mul", "*"), ("div", "/"), ("mod", "%"), ("pow", "**"), ("floordiv", "//"))
VLLM_PYTHON = Path.home() / "vllm-venv" / "bin" / "python"
SUMMARY_KEYS = ("output_throughput", "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "completed",
                "spec_decode_acceptance_rate", "spec_decode_mean_accepted_length")


def copy_prompts(n: int, seed: int) -> list[str]:
    """``n`` prompts whose answer copies from the prompt (a list to repeat, code to copy), varied by ``seed``:
    the workload where prompt lookup pays (as in bench_spec_ngram.py)."""
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(n):
        if i % 2 == 0:
            items = ", ".join(rng.permutation(FRUITS)[:12])
            prompts.append(f"Repeat this list exactly, three times: {items}. Again: {items}. Again:")
        else:
            ops = [OPS[j] for j in rng.permutation(len(OPS))[:4]]
            code = "".join(f"def {name}(a, b):\n    return a {sym} b\n\n" for name, sym in ops)
            prompts.append(f"Copy the following code exactly.\n\n{code}Copy:\n\ndef {ops[0][0]}")
    return prompts


def workload(tokenizer: Any, rate: float, num_requests: int, max_tokens: int, seed: int) -> list[WorkloadRequest]:
    """The requests served at ``rate``: token-id prompts (the same ids for every engine), Poisson arrivals."""
    arrivals = sample_arrival_times(num_requests, rate, 1.0, np.random.default_rng([seed, int(rate * 1000)]))
    return [WorkloadRequest(arrival_time=float(t), prompt=tokenizer.encode(p), max_tokens=max_tokens,
                            ignore_eos=True, request_id=f"r{i}")
            for i, (t, p) in enumerate(zip(arrivals, copy_prompts(num_requests, seed)))]


def configs(args: argparse.Namespace) -> dict[str, dict[str, Any] | None]:
    """The four speculation settings, by the name the table shows."""
    spec = dict(method=args.method, num_speculative_tokens=args.k)
    return {"none": None, "fixed": spec, "off_above_batch": {**spec, "policy": dict(name="off_above_batch",
                                                                                 max_batch=args.max_batch)},
            "adaptive": {**spec, "policy": "adaptive"}}


def _row(part: str, rate: float, config: str, summary: dict[str, Any]) -> dict[str, Any]:
    return {"part": part, "rate": rate, "config": config, **{k: summary.get(k) for k in SUMMARY_KEYS}}


class Results:
    """A part's rows, rewritten to ``OUT/<part>.json`` after each one, so a part cut short keeps what it ran."""

    def __init__(self, out: Path, part: str, args: argparse.Namespace) -> None:
        from nanovllm import machine

        self.path = out / f"{part}.json"
        self.started = time.perf_counter()
        self.data: dict[str, Any] = {"machine": machine.describe(1, bandwidth=False), "args": vars(args),
                                     "rows": [], "error": None}
        self.save()

    def add(self, row: dict[str, Any]) -> None:
        self.data["rows"].append(row)
        self.save()

    def save(self) -> None:
        self.data["wall_s"] = time.perf_counter() - self.started
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")


def run_real(args: argparse.Namespace, results: Results) -> None:
    from nanovllm import LLM
    from nanovllm.harness.serving import serve

    options = dict(dtype=args.dtype, num_kv_blocks=args.num_kv_blocks, max_model_len=1024,
                   max_num_seqs=args.max_num_seqs)
    engines = {name: LLM(**options, speculative=spec).engine for name, spec in configs(args).items()}
    tokenizer = next(iter(engines.values())).tokenizer
    names = list(engines)
    for index, rate in enumerate(args.rates):
        requests = workload(tokenizer, rate, args.num_requests, args.max_tokens, args.seed)
        for name in names[index % len(names):] + names[:index % len(names)]:
            started = time.perf_counter()
            result = serve(engines[name], requests, progress=False)
            results.add(_row("real", rate, name, result.summary))
            print(f"real rate={rate:g} {name}: {time.perf_counter() - started:.0f} s, "
                  f"{result.summary['output_throughput']:.1f} tok/s", flush=True)


def run_vllm(args: argparse.Namespace, results: Results) -> None:
    """vLLM without and with n-gram speculation, each its own server, stopped afterwards whatever happens; a
    server that fails to start is recorded as the part's error and the next one still runs."""
    from nanovllm.harness.http_client import HttpRunnerConfig, serve_over_http
    from transformers import AutoTokenizer

    from nanovllm.models.loader import resolve_model

    if not VLLM_PYTHON.is_file():
        raise SystemExit(f"error: vLLM's virtualenv is not at {VLLM_PYTHON} (see experiments/bench_vs_vllm.py)")
    model_dir = resolve_model(None)   # the dense HF directory vLLM reads (bench_vs_vllm.py does the same)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 1})
    for index, (name, extra) in enumerate((("vllm none", []), ("vllm ngram", ["--speculative-config", spec]))):
        if name.split()[1] not in args.vllm_configs:
            continue
        port = 8390 + index
        env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(args.vllm_core),
               "VLLM_CPU_KVCACHE_SPACE": "1"}
        command = ["taskset", "-c", str(args.vllm_core), str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
                   "--max-model-len", "1024", "--max-num-seqs", str(args.max_num_seqs), "--seed", "0", *extra]
        log = open(Path(args.out) / f"{name.replace(' ', '_')}.log", "w")
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}/v1"
            try:
                wait_up(url, proc, args.vllm_start_timeout)
            except RuntimeError as exc:
                results.data["error"] = f"{name}: {exc} (its log: {log.name})"
                results.save()
                print(f"error: {results.data['error']}", file=sys.stderr, flush=True)
                continue
            config = HttpRunnerConfig(url=url, timeout_s=300.0)
            serve_over_http(config, workload(tokenizer, 1.0, 2, 8, args.seed + 1))   # warm-up, untimed
            for rate in args.rates:
                before = _vllm_counters(url)
                result = serve_over_http(config, workload(tokenizer, rate, args.num_requests, args.max_tokens,
                                                          args.seed))
                after = _vllm_counters(url)
                drafts, proposed, accepted = (after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted"))
                summary = {**result.summary,
                           "spec_decode_acceptance_rate": accepted / proposed if proposed else None,
                           "spec_decode_mean_accepted_length": 1 + accepted / drafts if drafts else None}
                results.add(_row("vllm", rate, name, summary))
                print(f"vllm rate={rate:g} {name}: {summary['output_throughput']:.1f} tok/s", flush=True)
        finally:
            stop_vllm(proc)   # its EngineCore too
            log.close()


def _vllm_counters(url: str) -> dict[str, float]:
    """vLLM's speculation counters from its ``/metrics`` (zeros without speculation)."""
    text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    names = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_total": "accepted"}
    for line in text.splitlines():
        metric = line.split("{")[0].split(" ")[0]
        if metric in names:
            out[names[metric]] += float(line.rsplit(" ", 1)[1])
    return out


def _overrides(spec: dict[str, Any] | None) -> list[str]:
    """A configuration as ``python -m nanovllm.run`` overrides."""
    if spec is None:
        return ["speculative=none"]
    policy = spec.get("policy", "fixed")
    policy_text = policy if isinstance(policy, str) else "{" + ",".join(f"{k}:{v}" for k, v in policy.items()) + "}"
    return [f"speculative={spec['method']}", f"speculative.num_tokens={spec['num_speculative_tokens']}",
            f"speculative.policy={policy_text}"]


def write_trace(path: Path, tokenizer: Any, args: argparse.Namespace, rate: float, seed: int) -> Path:
    """The requests served at ``rate`` as a ``workload=trace`` JSONL file (a trace's prompt is text: the same
    prompts, arrivals and lengths as ``workload``)."""
    requests = workload(tokenizer, rate, args.num_requests, args.max_tokens, seed)
    texts = copy_prompts(args.num_requests, seed)
    path.write_text("".join(json.dumps({"arrival_time": w.arrival_time, "prompt": text, "output_len": w.max_tokens,
                                        "request_id": w.request_id}) + "\n" for w, text in zip(requests, texts)))
    return path


def calibrated_overrides(args: argparse.Namespace, tokenizer: Any, out: Path) -> list[str]:
    """The simulator's profile and acceptance model for this study, from real runs it is not compared with:
    ``fixed`` (``--method``, ``--k``) on this workload with seed ``--seed + 1`` at the lowest and the highest
    of ``--rates`` (``python -m nanovllm.run``, one torch thread), the profile calibrated on them
    (``nanovllm.harness.sim.calibrate``: the target's step terms with proposals as prompt-like rows, and the
    proposer's own cost) and the acceptance fitted on their requests (``runner.acceptance=fitted``). Runs that
    finished before (their ``metrics.json`` is there) are reused."""
    from sim_spec_accuracy import merged_calibration_run

    from nanovllm.harness.sim.this_machine import run_engine

    out.mkdir(parents=True, exist_ok=True)
    seed, runs = args.seed + 1, []
    for rate in sorted({min(args.rates), max(args.rates)}):
        # Named by everything that shapes the run, so a reused run is the one these arguments would make.
        run_dir = out / (f"fixed_{args.method}_k{args.k}_{args.dtype}_rate{rate:g}_n{args.num_requests}_"
                         f"t{args.max_tokens}_seqs{args.max_num_seqs}_blocks{args.num_kv_blocks}_seed{seed}")
        if not (run_dir / "metrics.json").is_file():
            trace = write_trace(out / f"rate{rate:g}_seed{seed}.jsonl", tokenizer, args, rate, seed)
            run_engine(["workload=trace", f"workload.path={trace}", f"engine.max_num_seqs={args.max_num_seqs}",
                        f"engine.num_kv_blocks={args.num_kv_blocks}", *_overrides(configs(args)["fixed"])],
                       run_dir, args.dtype, threads=1)
        runs.append(run_dir)
    profile = out / "profile.yaml"
    subprocess.run([sys.executable, "-m", "nanovllm.harness.sim.calibrate", *map(str, runs), "--out", str(profile),
                    "--knee-rows", str(args.knee_rows)], check=True)
    accepted = merged_calibration_run(runs, out / "requests")
    return [f"runner.profile={profile}", "runner.acceptance=fitted", f"runner.acceptance_run={accepted}"]


def run_sim(args: argparse.Namespace, results: Results) -> None:
    """The same configurations and requests on ``runner=sim`` (a JSONL trace per rate), on a profile and an
    acceptance model calibrated here (``calibrated_overrides``) unless ``--sim-override runner.profile=...``
    gives one; ``--sim-override`` passes further overrides."""
    from transformers import AutoTokenizer

    from nanovllm.engine.runner import RUNNERS
    from nanovllm.harness import runners  # noqa: F401  (registers runner=sim)
    from nanovllm.models.loader import resolve_model

    if not RUNNERS.get("sim").supports_speculation:   # asked first: the answer holds for every configuration
        raise SystemExit("error: runner=sim does not price speculative decoding in this tree (its runner says "
                         "supports_speculation=False), so --part sim cannot run fixed, off_above_batch or adaptive; "
                         "it needs the simulator's speculation pricing (issue #58)")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None, weights=False), trust_remote_code=False)
    with tempfile.TemporaryDirectory() as scratch:
        overrides = list(args.sim_override)
        if not any(o.startswith("runner.profile=") for o in overrides):
            overrides = calibrated_overrides(args, tokenizer, Path(args.out) / "calibration") + overrides
            results.data["calibration"] = overrides
        for rate in args.rates:
            trace = write_trace(Path(scratch) / f"rate{rate:g}.jsonl", tokenizer, args, rate, args.seed)
            for name, spec in configs(args).items():
                run_dir = Path(scratch) / f"{rate:g}-{name}"
                command = [sys.executable, "-m", "nanovllm.run", "runner=sim", "workload=trace",
                           f"workload.path={trace}", f"engine.dtype={args.dtype}",
                           f"engine.max_num_seqs={args.max_num_seqs}", f"engine.num_kv_blocks={args.num_kv_blocks}",
                           "progress=false", f"hydra.run.dir={run_dir}", *_overrides(spec), *overrides]
                proc = subprocess.run(command, capture_output=True, text=True)
                if proc.returncode != 0:
                    last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                    raise SystemExit(f"error: runner=sim failed on config {name!r} at rate {rate:g}: {last}\n"
                                     f"(command: {' '.join(command)})")
                summary = json.loads((run_dir / "metrics.json").read_text())
                results.add(_row("sim", rate, name, summary))
                print(f"sim rate={rate:g} {name}: {summary['output_throughput']:.1f} tok/s", flush=True)


def _fmt(value: Any, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def table(out: Path) -> str:
    """Every part's rows found in ``out``, by part, rate and config, with throughput relative to ``none``."""
    parts = {part: json.loads((out / f"{part}.json").read_text()) for part in ("real", "vllm", "sim")
             if (out / f"{part}.json").is_file()}
    rows = [row for data in parts.values() for row in data["rows"]]
    base = {(r["part"], r["rate"]): r["output_throughput"] for r in rows if r["config"] in ("none", "vllm none")}
    lines = ["| part | rate (req/s) | config | output tok/s | x none | p50 TPOT ms | p99 TPOT ms | p50 TTFT ms "
             "| acceptance | mean accepted length | completed |", "|" + "---|" * 11]
    order = ("none", "fixed", "off_above_batch", "adaptive", "vllm none", "vllm ngram")
    for r in sorted(rows, key=lambda r: (("real", "vllm", "sim").index(r["part"]), r["rate"],
                                         order.index(r["config"]) if r["config"] in order else len(order))):
        none = base.get((r["part"], r["rate"]))
        ratio = r["output_throughput"] / none if none and r["output_throughput"] is not None else None
        lines.append(f"| {r['part']} | {r['rate']:g} | {r['config']} | {_fmt(r['output_throughput'])} "
                     f"| {_fmt(ratio, 2)} | {_fmt(r['median_tpot_ms'])} | {_fmt(r['p99_tpot_ms'])} "
                     f"| {_fmt(r['median_ttft_ms'], 0)} | {_fmt(r['spec_decode_acceptance_rate'], 2)} "
                     f"| {_fmt(r['spec_decode_mean_accepted_length'], 2)} | {r['completed']} |")
    lines += [f"{part}: {data['error']}" for part, data in parts.items() if data.get("error")]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("real", "vllm", "sim", "table"), default="real")
    parser.add_argument("--rates", default="0.2,0.5,1", help="request rates (req/s), comma-separated")
    parser.add_argument("--num-requests", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--method", default="ngram", help="the proposer (ngram, draft, ...); vLLM's rows are ngram")
    parser.add_argument("--max-batch", type=int, default=2, help="off_above_batch's max_batch")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--num-kv-blocks", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-core", type=int, default=1, help="the core vLLM's server is pinned to")
    parser.add_argument("--vllm-start-timeout", type=float, default=900.0,
                        help="seconds a vLLM server may take to start (its CPU build compiles on a cold cache)")
    parser.add_argument("--vllm-configs", default="none,ngram", help="which vLLM servers to run")
    parser.add_argument("--sim-override", action="append", default=[], help="a further override for runner=sim")
    parser.add_argument("--knee-rows", default="0",
                        help="--part sim: the calibration's bend in the step cost (calibrate --knee-rows: 0, N, fit)")
    parser.add_argument("--out", default="outputs/spec_vs_rate")
    args = parser.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.vllm_configs = args.vllm_configs.split(",")
    if args.part != "table":
        {"real": run_real, "vllm": run_vllm, "sim": run_sim}[args.part](args, Results(out, args.part, args))
    print(table(out))


if __name__ == "__main__":
    main()
