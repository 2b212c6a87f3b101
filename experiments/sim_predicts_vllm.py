"""The simulator predicts vLLM: calibrated only from what a client of vLLM's OpenAI server sees, it runs vLLM's
scheduling rules (``scheduler=vllm_v1``) on held-out workloads, side by side with vLLM serving them::

    python experiments/sim_predicts_vllm.py --vllm-python /root/vllm-venv/bin/python [--json FILE]
        [--dtype bfloat16] [--vllm-core 1] [--api-core 0] [--port 8395] [--repeats 2] [--rounds 2]
        [--simulate-only [--knee-rows N]]

One run, in this order: vLLM's OpenAI server starts (``python -m vllm.entrypoints.openai.api_server`` from
``--vllm-python``, the default model in ``--dtype``, 127.0.0.1, pinned to ``--vllm-core`` with
``VLLM_CPU_OMP_THREADS_BIND``; with ``--api-core`` its API process and EngineCore on that core instead, beside
the client; the recipe of its virtualenv is in ``bench_vs_vllm.py``) with vLLM CPU's API-server
defaults passed explicitly (``max_num_batched_tokens`` 2048, ``max_num_seqs`` 128, block size 128, chunked
prefill and prefix caching on: ``policies/vllm_v1.py``) and a 1 GiB KV cache. Then
``nanovllm.harness.sim.calibrate_server`` sends its calibration workload (single requests over prompt lengths,
bursts over batch sizes) and fits the ``calibrated`` profile from the client-side TTFT and inter-token
latencies (``--repeats`` rounds of it). Then the held-out workloads, none of which the calibration saw, are sent
to vLLM by the HTTP client of ``runner=http`` (token-id prompts, streamed), ``--rounds`` times, taking turns, vLLM's
prefix cache emptied before each (``POST /reset_prefix_cache``, dev mode):

- ``chat_low``: 24 chat prompts (37-261 tokens) at 1 request/s (Poisson), up to 64 tokens, ending at EOS;
- ``saturating``: 64 random prompts of 128-384 tokens, 64-192 output tokens (EOS ignored), 16 requests/s: the
  queue and the batch grow past what one core serves;
- ``shared_prefix``: 48 requests at 8/s, each one of four 256-token system prompts (two full 128-token blocks,
  cached by vLLM's prefix caching) plus 16-48 tokens of its own, 16-48 output tokens.

vLLM is stopped (its process group, then any EngineCore left over, by id) and each workload is simulated with
``scheduler=vllm_v1``, the same engine caps and block size, ``allocator=prefix`` publishing a block as a hit when
its step is scheduled (vLLM's rule; ``--publish computed``: after its step), the KV blocks vLLM's 1 GiB
holds, and each request's output length as vLLM produced it in the first round (chat requests end at EOS, which
only the model knows). The profile's client overhead is added to the simulated records (``with_client_overhead``:
TTFT and E2E). The table gives p50/p90 TTFT, p50 TPOT, p50 E2E latency and output throughput: vLLM's rounds,
their mean and spread ((max - min) / mean), the simulated figure, its error against the mean, whether that is
within 15%, and against how many single rounds it is. The client and the simulator run on this process's core (run it under
``taskset -c 0``); ``/tmp/vllm_measuring`` exists while vLLM is measured. vLLM's records and the profile stay in
``--out`` (not tracked); ``--simulate-only`` simulates again from them, without vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from policies.vllm_v1 import VLLM_CPU_BLOCK_SIZE, VLLM_CPU_MAX_NUM_BATCHED_TOKENS, VLLM_CPU_MAX_NUM_SEQS  # noqa: E402

from nanovllm.harness.sim.calibrate_server import (  # noqa: E402
    CalibrationPlan,
    calibrate_server,
    refit,
    with_client_overhead,
)
from nanovllm.harness.workload import WorkloadRequest  # noqa: E402
from vllm_server import stop_vllm, wait_up  # noqa: E402

MEASURING = Path("/tmp/vllm_measuring")   # while it exists, the machine's other jobs keep quiet
KV_CACHE_GIB = 1
MAX_MODEL_LEN = 2048
SERVED_NAME = "SmolLM2-135M-Instruct"
WITHIN = 0.15
METRICS = [("p50 TTFT ms", "median_ttft_ms"), ("p90 TTFT ms", "p90_ttft_ms"), ("p50 TPOT ms", "median_tpot_ms"),
           ("p50 E2E ms", "median_e2el_ms"), ("output tok/s", "output_throughput")]


def held_out_workloads(tokenizer: Any) -> dict[str, list[WorkloadRequest]]:
    """The three compared workloads (module docstring), each request with its own id."""
    from nanovllm.harness.workload import generate_workload
    from nanovllm.harness.workload.config import ChatWorkloadConfig, LengthDist, SyntheticWorkloadConfig

    configs = {
        "chat_low": ChatWorkloadConfig(num_requests=24, request_rate=1.0, max_tokens=64, seed=0),
        "saturating": SyntheticWorkloadConfig(
            num_requests=64, request_rate=16.0, input_len=LengthDist("uniform", 256, 0.5),
            output_len=LengthDist("uniform", 128, 0.5), seed=0),
        "shared_prefix": SyntheticWorkloadConfig(
            num_requests=48, request_rate=8.0, num_prefix_groups=4, prefix_len=256,
            input_len=LengthDist("uniform", 32, 0.5), output_len=LengthDist("uniform", 32, 0.5), seed=0),
    }
    return {name: [dataclasses.replace(w, request_id=f"{name}-{i}")
                   for i, w in enumerate(generate_workload(cfg, tokenizer))]
            for name, cfg in configs.items()}


def kv_blocks(model_dir: Path, dtype: str) -> int:
    """The blocks of ``VLLM_CPU_BLOCK_SIZE`` tokens that vLLM's ``KV_CACHE_GIB`` hold for this model."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * (2 if dtype != "float32" else 4)
    return KV_CACHE_GIB * 2**30 // (per_token * VLLM_CPU_BLOCK_SIZE)


def start_vllm(python: str, model_dir: Path, dtype: str, port: int, core: int, log_path: Path,
               api_core: int | None = None) -> subprocess.Popen:
    """vLLM's OpenAI server in a process group of its own (so it and its EngineCore stop together): its
    EngineCore's compute thread bound to ``core`` (``VLLM_CPU_OMP_THREADS_BIND``), the API process (HTTP,
    detokenizing, streaming) and the EngineCore's I/O threads on ``api_core`` (None: ``core`` too)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
           "VLLM_SERVER_DEV_MODE": "1"}   # for POST /reset_prefix_cache between workloads
    command = ["taskset", "-c", str(core if api_core is None else api_core), python, "-m",
               "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0",
               "--max-num-batched-tokens", str(VLLM_CPU_MAX_NUM_BATCHED_TOKENS),
               "--max-num-seqs", str(VLLM_CPU_MAX_NUM_SEQS), "--block-size", str(VLLM_CPU_BLOCK_SIZE),
               "--enable-prefix-caching", "--enable-chunked-prefill",
               "--enable-prompt-tokens-details"]   # each reply's cached_tokens: the prefix-cache hit rate
    log = open(log_path, "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def knee_choice(knee_rows: int | None) -> int | None | str:
    """``--knee-rows`` as ``calibrate_server.fit`` takes it: None fits the bend, 0 fits none."""
    return "fit" if knee_rows is None else knee_rows


def reset_prefix_cache(url: str) -> None:
    """Empty vLLM's prefix cache (its dev-mode endpoint), so a workload served again finds none of its own
    prompts cached from the round before."""
    request = urllib.request.Request(url.removesuffix("/v1") + "/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        if response.status != 200:
            raise SystemExit(f"error: vLLM's POST /reset_prefix_cache answered HTTP {response.status}")


def measure_vllm(args: argparse.Namespace, model_dir: Path, workloads: dict[str, list[WorkloadRequest]],
                 out: Path) -> tuple[dict[str, Any], dict[str, list[list[Any]]]]:
    """Start vLLM, calibrate, serve every held-out workload; vLLM stopped whatever happens."""
    from nanovllm.harness.http_client import HttpRunnerConfig, serve_over_http

    url = f"http://127.0.0.1:{args.port}/v1"
    log_path = out / "vllm_server.log"
    MEASURING.touch()
    proc = start_vllm(args.vllm_python, model_dir, args.dtype, args.port, args.vllm_core, log_path,
                      args.api_core)
    try:
        try:
            wait_up(url, proc, log_path=log_path)
        except RuntimeError as exc:
            raise SystemExit(f"error: {exc}") from None
        started = time.monotonic()
        plan = CalibrationPlan(url=url, model=SERVED_NAME, repeats=args.repeats)
        command = f"python experiments/sim_predicts_vllm.py {' '.join(sys.argv[1:])}".strip()
        profile = calibrate_server(plan, out / "vllm_profile.yaml", dtype=args.dtype, command=command,
                                   knee_rows=knee_choice(args.knee_rows))
        print(f"calibrated in {time.monotonic() - started:.0f} s: client overhead "
              f"{profile['client_overhead'] * 1e3:.1f} ms, median |fit error| "
              f"{profile['fit']['median_abs_rel_error']:.1%}", flush=True)
        config = HttpRunnerConfig(url=url, model=SERVED_NAME, timeout_s=600.0)
        real: dict[str, list[list[Any]]] = {name: [] for name in workloads}
        for round_ in range(1, args.rounds + 1):   # the workloads take turns, so drift hits each alike
            for name, workload in workloads.items():
                reset_prefix_cache(url)   # each round starts cold, as the simulation does
                result = serve_over_http(config, workload)
                failed = [r for r in result.requests if r["error"] is not None]
                if failed:
                    raise SystemExit(f"error: {len(failed)} requests of {name} failed on vLLM: {failed[0]['error']}")
                real[name].append(result.requests)
                print(f"vLLM {name} round {round_}: {result.summary['output_throughput']:.1f} output tok/s "
                      f"({time.monotonic() - started:.0f} s in)", flush=True)
    finally:
        killed = stop_vllm(proc)
        MEASURING.unlink(missing_ok=True)
        if killed:
            print(f"vLLM processes left after its server stopped, killed: {killed}", flush=True)
    return profile, real


def simulate(workload: list[WorkloadRequest], real: list[Any], profile_path: Path, dtype: str,
             num_kv_blocks: int, overhead: float, publish: str = "scheduled") -> list[Any]:
    """The workload on ``runner=sim`` with vLLM's scheduler and settings; each request stops at vLLM's output
    length; the client overhead added. ``publish``: when a full block becomes a prefix hit (``scheduled`` is
    vLLM's rule)."""
    from nanovllm.config import EngineConfig
    from nanovllm.harness.sim import Simulation

    config = EngineConfig(dtype=dtype, block_size=VLLM_CPU_BLOCK_SIZE, num_kv_blocks=num_kv_blocks,
                          max_num_seqs=VLLM_CPU_MAX_NUM_SEQS, max_num_batched_tokens=VLLM_CPU_MAX_NUM_BATCHED_TOKENS,
                          max_model_len=MAX_MODEL_LEN)
    sim = Simulation.build(config, "calibrated", profile=str(profile_path), allocator={"name": "prefix", "publish": publish},
                           scheduler={"name": "vllm_v1", "max_num_batched_tokens": VLLM_CPU_MAX_NUM_BATCHED_TOKENS,
                                      "max_num_seqs": VLLM_CPU_MAX_NUM_SEQS},
                           output_lengths={r["request_id"]: r["num_output_tokens"] for r in real})
    return with_client_overhead(sim.serve(workload, progress=False).requests, overhead)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="the python of a virtualenv with vllm-cpu installed")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--vllm-core", type=int, default=1, help="the core vLLM is pinned to")
    parser.add_argument("--api-core", type=int, default=None,
                        help="the core of vLLM's API process and the EngineCore's I/O threads (default: --vllm-core)")
    parser.add_argument("--port", type=int, default=8395)
    parser.add_argument("--repeats", type=int, default=2, help="calibration rounds (single requests and bursts)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the held-out workloads on vLLM")
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "sim_vs_vllm"),  # .gitignore
                        help="directory for vLLM's log and the fitted profile (not tracked)")
    parser.add_argument("--json", default=None, help="also write the table's figures to this file")
    parser.add_argument("--simulate-only", action="store_true",
                        help="no vLLM: fit the last run's calibration again (--knee-rows) and simulate from it and "
                             "vLLM's records the last run left in --out")
    parser.add_argument("--knee-rows", type=int, default=None,
                        help="the row count where vLLM's step cost bends (default: fitted; 0: no bend)")
    parser.add_argument("--publish", default="scheduled", choices=("scheduled", "computed"),
                        help="when the simulated prefix cache makes a block a hit (allocator.publish; vLLM: "
                             "when the step computing it is scheduled)")
    args = parser.parse_args()
    if not Path(args.vllm_python).is_file():
        parser.error(f"--vllm-python: {args.vllm_python} does not exist")
    from transformers import AutoTokenizer

    from nanovllm import machine
    from nanovllm.models.loader import resolve_model
    from nanovllm.serving.metrics import summarize

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(machine.header(info=machine.describe(1)), flush=True)
    model_dir = resolve_model(None)   # the dense HF directory vLLM reads (bench_vs_vllm.py does the same)
    workloads = held_out_workloads(AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False))
    saved = out / "vllm_records.json"
    if args.simulate_only:
        if not saved.is_file():
            parser.error(f"--simulate-only: no {saved} (run without it first)")
        # The same measurements fitted again, so a choice of terms (--knee-rows) is compared on one calibration.
        profile = refit(yaml.safe_load((out / "vllm_profile.yaml").read_text()), knee_choice(args.knee_rows))
        (out / "vllm_profile_refit.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
        real = json.loads(saved.read_text())
    else:
        profile, real = measure_vllm(args, model_dir, workloads, out)
        saved.write_text(json.dumps(real))
    blocks = kv_blocks(model_dir, args.dtype)
    rows = []
    hits = []
    for name, workload in workloads.items():
        # Output lengths from the first round (greedy: every round produces the same tokens).
        profile_path = out / ("vllm_profile_refit.yaml" if args.simulate_only else "vllm_profile.yaml")
        simulated = simulate(workload, real[name][0], profile_path, args.dtype, blocks, profile["client_overhead"],
                             args.publish)
        rounds, ours = [summarize(records, ()) for records in real[name]], summarize(simulated, ())
        hits.append(f"{name} {rounds[0]['prefix_cache_hit_rate']:.0%} / {ours['prefix_cache_hit_rate']:.0%}")
        for label, key in METRICS:
            values = [r[key] for r in rounds]
            mean = statistics.fmean(values)
            rows.append({"workload": name, "metric": label, "vllm_rounds": values, "vllm": mean, "sim": ours[key],
                         "spread": (max(values) - min(values)) / mean, "error": ours[key] / mean - 1,
                         "rounds_within": sum(abs(ours[key] / v - 1) <= WITHIN for v in values)})
    api = "" if args.api_core is None else f", its API process on core {args.api_core}"
    knee = f"bend at {profile['knee_rows']} rows" if profile.get("knee_rows") else "no bend"
    print(f"\nheld-out workloads, vLLM {args.dtype} on core {args.vllm_core}{api} vs runner=sim scheduler=vllm_v1 "
          f"allocator=prefix publish={args.publish} ({blocks} blocks of {VLLM_CPU_BLOCK_SIZE}), profile fitted from vLLM's client-side "
          f"calibration (client overhead {profile['client_overhead'] * 1e3:.1f} ms, {knee}, median |fit error| "
          f"{profile['fit']['median_abs_rel_error']:.1%})")
    print("| workload | metric | vLLM rounds | vLLM mean | vLLM spread | simulated | error vs mean | within 15% | "
          "rounds within 15% |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['workload']} | {row['metric']} | {' / '.join(f'{v:.1f}' for v in row['vllm_rounds'])} | "
              f"{row['vllm']:.1f} | {row['spread']:.0%} | {row['sim']:.1f} | {row['error']:+.1%} | "
              f"{'yes' if abs(row['error']) <= WITHIN else 'no'} | {row['rounds_within']}/{len(row['vllm_rounds'])} |")
    print(f"\nprefix-cache hit rate, vLLM / simulated: {'; '.join(hits)}")
    within = sum(abs(r["error"]) <= WITHIN for r in rows)
    print(f"\n{within}/{len(rows)} figures within 15%")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": profile, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
