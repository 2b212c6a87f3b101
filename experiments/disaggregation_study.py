"""Colocated vs prefill/decode-disaggregated replicas at equal replica counts, under increasing load, on a
long-prompt workload: simulated at 16 and 64 replicas of a GPU, and at 2 real processes on this machine with the
simulator's prediction beside them.

    python experiments/disaggregation_study.py sim  [--scales 16,64] [--rates 0.5,1,2,3,4] [--requests-per-replica 40]
    python experiments/disaggregation_study.py real [--rates 0.2,0.35,0.5] [--requests 24] [--dtype float32]
    python experiments/disaggregation_study.py render

sim: Llama-3-8B (``nanovllm/data/models/llama-3-8b``: its architecture, no weights) in bfloat16 on the H100 SXM
profile (``conf/hardware/h100_sxm.yaml``, the analytical step-time model; K/V over its NVLink figures). At N
replicas: N colocated, N/4 prefill + 3N/4 decode, and N/2 + N/2, each behind least_loaded (both pools). The
workload: Poisson arrivals at ``rate`` x N requests/s, prompts 2048 +- 50% tokens, outputs 256 +- 50%. Goodput is
DistServe's: requests per second that meet both SLOs (TTFT <= ``TTFT_SLO_MS``, TPOT <= ``TPOT_SLO_MS``).

real: the default model in ``--dtype`` (float32: on a CPU without AVX-512 BF16 bfloat16 was the slower dtype when this study was set up) on this machine, 2 replicas in Ray actors (one thread each): 2 colocated vs
1 prefill + 1 decode (shared-memory K/V), prompts 192 +- 25% tokens, 32 output tokens, at each rate. The simulator
is calibrated as for the routers study (``cluster_real_vs_sim.py``): on real runs of this workload (both
configurations, the middle rate, seed 1), never on the runs it is compared with (seed 0); its K/V transfers take
what ``bench_kv_transfer.py`` measured (``conf/kv_transfer/shared_memory.yaml``).

Writes ``experiments/results/disaggregation.md`` and the measurements (``.json``) beside it (each part
replaces its own section; ``render`` rebuilds the page from the ``.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from nanovllm import machine  # noqa: E402
from nanovllm.cluster.config import ClusterConfig  # noqa: E402
from nanovllm.config import EngineConfig  # noqa: E402
from nanovllm.harness.cluster import ServedCluster  # noqa: E402
from nanovllm.harness.sim.calibrate import calibrate  # noqa: E402
from nanovllm.harness.workload import LengthDist, SyntheticWorkloadConfig, generate_workload  # noqa: E402
from nanovllm.serving.loggers import JsonlLogger  # noqa: E402
from nanovllm.serving.metrics import SLO  # noqa: E402

OUT = ROOT / "experiments" / "results" / "disaggregation.md"
GPU_MODEL = ROOT / "nanovllm" / "data" / "models" / "llama-3-8b"
HARDWARE = ROOT / "conf" / "hardware" / "h100_sxm.yaml"
TTFT_SLO_MS, TPOT_SLO_MS = 1000.0, 40.0           # the GPU study's SLOs (a chatbot's, loose on TPOT)
TIGHT_TPOT_SLO_MS = 12.0                          # and a tight TPOT target (a code assistant's)
REAL_TTFT_SLO_MS, REAL_TPOT_SLO_MS = 3000.0, 150.0  # this machine's (a CPU is far slower)
ROUTER = {"name": "least_loaded", "prefill": None, "decode": None}
CALIBRATION_SEED = 1


def shapes(replicas: int) -> list[tuple[str, ClusterConfig]]:
    """Colocated, 1:3 and 1:1 prefill:decode at ``replicas`` replicas."""
    out = [(f"{replicas} colocated", ClusterConfig(replicas=replicas))]
    for prefill in (replicas // 4, replicas // 2):
        if prefill >= 1 and replicas - prefill >= 1:
            out.append((f"{prefill}P+{replicas - prefill}D",
                        ClusterConfig(prefill_replicas=prefill, decode_replicas=replicas - prefill)))
    return out


def goodput(records, duration: float, ttft_ms: float, tpot_ms: float) -> float:
    """Requests/s that completed within both SLOs."""
    from nanovllm.serving.metrics import is_completed, tpot_s, ttft_s

    good = sum(1 for r in records if is_completed(r) and ttft_s(r) * 1e3 <= ttft_ms
               and (tpot_s(r) is None or tpot_s(r) * 1e3 <= tpot_ms))
    return good / duration if duration > 0 else 0.0


def figures(result, replicas: int) -> dict:
    s = result.summary
    split = s.get("disaggregation") or {}
    return {"tok_s": s["output_throughput"], "req_s": s["request_throughput"], "p50_ttft_ms": s["median_ttft_ms"],
            "p99_ttft_ms": s["p99_ttft_ms"], "p50_tpot_ms": s["median_tpot_ms"], "p99_tpot_ms": s["p99_tpot_ms"],
            "goodput": s["request_goodput"], "goodput_fraction": s["goodput_fraction"], "failed": s["failed"],
            "preemptions": s["num_preemptions"], "kv_transfer_p50_ms": split.get("kv_transfer_time_p50_ms"),
            "ttft_queue_p50_ms": split.get("ttft_queue_p50_ms"), "ttft_prefill_p50_ms": split.get("ttft_prefill_p50_ms"),
            "prefill_busy": split.get("prefill_pool_busy"), "decode_busy": split.get("decode_pool_busy"),
            "replicas": replicas,
            "goodput_tight": goodput(result.requests, s["duration"], TTFT_SLO_MS, TIGHT_TPOT_SLO_MS)}


# -- simulated, at scale ---------------------------------------------------------------------------------------

def gpu_workload(num_requests: int, rate: float, seed: int = 0) -> SyntheticWorkloadConfig:
    return SyntheticWorkloadConfig(num_requests=num_requests, request_rate=rate, seed=seed,
                                   input_len=LengthDist(kind="uniform", mean=2048, range_ratio=0.5),
                                   output_len=LengthDist(kind="uniform", mean=256, range_ratio=0.5))


def simulate_gpu(args: argparse.Namespace) -> dict:
    hardware = yaml.safe_load(HARDWARE.read_text(encoding="utf-8"))
    config = EngineConfig(model=str(GPU_MODEL), dtype="bfloat16", max_num_seqs=128)
    runner = {"name": "sim", "step_time": "analytical"}
    slo = SLO(ttft_ms=TTFT_SLO_MS, tpot_ms=TPOT_SLO_MS)
    rows = []
    for replicas in map(int, args.scales.split(",")):
        for rate in map(float, args.rates.split(",")):
            for name, cluster in shapes(replicas):
                started = time.perf_counter()
                served = ServedCluster.simulated(cluster, ROUTER, runner, hardware, config)
                workload = generate_workload(gpu_workload(args.requests_per_replica * replicas, rate * replicas),
                                             served.engine.tokenizer)
                row = {"shape": name, "rate_per_replica": rate, **figures(served.serve(workload, slo=slo), replicas),
                       "wall_s": time.perf_counter() - started}
                rows.append(row)
                print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return {"command": "python experiments/disaggregation_study.py sim " + " ".join(
        f"--{k.replace('_', '-')} {getattr(args, k)}" for k in ("scales", "rates", "requests_per_replica")),
        "rows": rows, "slo": [TTFT_SLO_MS, TPOT_SLO_MS]}


# -- real, 2 processes on this machine -------------------------------------------------------------------------

def cpu_workload(num_requests: int, rate: float, seed: int = 0) -> SyntheticWorkloadConfig:
    return SyntheticWorkloadConfig(num_requests=num_requests, request_rate=rate, seed=seed,
                                   input_len=LengthDist(kind="uniform", mean=192, range_ratio=0.25),
                                   output_len=LengthDist(kind="fixed", mean=32))


def real_engine(dtype: str) -> EngineConfig:
    return EngineConfig(dtype=dtype, num_kv_blocks=256, max_num_seqs=16, max_model_len=1024)


def serve_real(cluster: ClusterConfig, args: argparse.Namespace, rate: float, seed: int = 0,
               run_dir: Path | None = None) -> dict:
    served = ServedCluster.real(cluster, ROUTER, real_engine(args.dtype), allocator="prefix")
    loggers = []
    if run_dir is not None:
        logger = JsonlLogger()
        logger.start(run_dir, {"engine": {"dtype": args.dtype}, "model": {"path": None},
                               "attention": {"name": "cpu"}}, name=run_dir.name)
        loggers.append(logger)
    try:
        workload = generate_workload(cpu_workload(args.requests, rate, seed), served.engine.tokenizer)
        result = served.serve(workload, loggers=loggers, progress=False,
                              slo=SLO(ttft_ms=REAL_TTFT_SLO_MS, tpot_ms=REAL_TPOT_SLO_MS))
        return figures(result, 2)
    finally:
        for logger in loggers:
            logger.finish()
        served.close()


def simulate_real(cluster: ClusterConfig, args: argparse.Namespace, rate: float, profile: Path) -> dict:
    runner = {"name": "sim", "step_time": "calibrated", "profile": str(profile)}
    served = ServedCluster.simulated(cluster, ROUTER, runner, None, real_engine(args.dtype), allocator="prefix")
    workload = generate_workload(cpu_workload(args.requests, rate), served.engine.tokenizer)
    return figures(served.serve(workload, slo=SLO(ttft_ms=REAL_TTFT_SLO_MS, tpot_ms=REAL_TPOT_SLO_MS)), 2)


def measure_real(args: argparse.Namespace, out: Path) -> dict:
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    rates = [float(r) for r in args.rates.split(",")]
    shapes_2 = shapes(2)[:2]   # 2 colocated, 1P+1D
    profile = out.with_name(out.stem + "_profile.yaml")
    if args.profile:
        profile = Path(args.profile)
    else:
        runs = Path(tempfile.mkdtemp(prefix="disagg_calibration_"))
        run_dirs = []
        for name, cluster in shapes_2:
            run_dir = runs / f"{name.replace(' ', '_').replace('+', '_')}_seed{CALIBRATION_SEED}"
            print(f"calibration run: {run_dir.name}", flush=True)
            serve_real(cluster, args, rates[len(rates) // 2], CALIBRATION_SEED, run_dir)
            run_dirs.append(run_dir)
        fitted = calibrate(run_dirs, profile, command="python experiments/disaggregation_study.py real "
                                                      "(its calibration step)")
        print(f"profile: {profile} ({fitted['num_steps']} steps, R^2 {fitted['fit']['r2']:.3f})", flush=True)
    rows = []
    for rate in rates:
        for name, cluster in shapes_2:
            real = serve_real(cluster, args, rate)
            sim = simulate_real(cluster, args, rate, profile)
            rows.append({"shape": name, "rate": rate, "real": real, "sim": sim})
            print(name, rate, "real", real, "sim", sim, flush=True)
    return {"command": "python experiments/disaggregation_study.py real " + " ".join(
        f"--{k} {getattr(args, k)}" for k in ("rates", "requests", "dtype")) + (
        f" --profile {args.profile}" if args.profile else ""),
        "header": machine.header(1), "profile": profile.name, "rows": rows,
        "slo": [REAL_TTFT_SLO_MS, REAL_TPOT_SLO_MS], "wall_s": time.perf_counter() - started}


# -- the page --------------------------------------------------------------------------------------------------

def _f(value, spec=".1f") -> str:
    return "-" if value is None else format(value, spec)


def report(data: dict) -> str:
    lines = ["# Colocated vs disaggregated prefill/decode", ""]
    sim = data.get("sim")
    if sim:
        lines += ["## Simulated: Llama-3-8B on H100 SXM, 16 and 64 replicas", "",
                  f"Command: `{sim['command']}`. Goodput = requests/s meeting both SLOs (DistServe): TTFT <= "
                  f"{sim['slo'][0]:g} ms and TPOT <= {sim['slo'][1]:g} ms (loose), or TPOT <= {TIGHT_TPOT_SLO_MS:g} ms "
                  "(tight). Rate is per replica (the cluster gets N times it).",
                  "", "| replicas | rate/replica | shape | goodput req/s | goodput % | goodput tight-TPOT | tok/s | "
                  "p50 TTFT ms | p99 TTFT ms | p50 TPOT ms | p99 TPOT ms | KV transfer p50 ms | prefill/decode busy |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sim["rows"]:
            busy = "-" if r["prefill_busy"] is None else f"{r['prefill_busy']:.2f}/{r['decode_busy']:.2f}"
            lines.append(f"| {r['replicas']} | {r['rate_per_replica']:g} | {r['shape']} | {_f(r['goodput'])} | "
                         f"{_f(100 * r['goodput_fraction'], '.0f')} | {_f(r['goodput_tight'])} | "
                         f"{_f(r['tok_s'], '.0f')} | "
                         f"{_f(r['p50_ttft_ms'], '.0f')} | {_f(r['p99_ttft_ms'], '.0f')} | {_f(r['p50_tpot_ms'])} | "
                         f"{_f(r['p99_tpot_ms'])} | {_f(r['kv_transfer_p50_ms'], '.2f')} | {busy} |")
        lines.append("")
    real = data.get("real")
    if real:
        lines += ["## Real: 2 processes on this machine, and the simulator beside them", "", real["header"], "",
                  f"Command: `{real['command']}` ({real['wall_s']:.0f} s). Simulated on `{real['profile']}`, "
                  "fitted on real runs of this workload (both shapes, seed 1), not on the runs below (seed 0). "
                  f"SLOs: TTFT <= {real['slo'][0]:g} ms, TPOT <= {real['slo'][1]:g} ms.", "",
                  "| rate req/s | shape | real tok/s | sim/real | real p50 TTFT ms | sim/real | real p50 TPOT ms | "
                  "sim/real | real goodput % | sim goodput % | real KV transfer p50 ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        worst = {"tok_s": 1.0, "p50_ttft_ms": 1.0}
        for r in real["rows"]:
            a, b = r["real"], r["sim"]
            ratios = {k: b[k] / a[k] if a[k] else None for k in ("tok_s", "p50_ttft_ms", "p50_tpot_ms")}
            for key in worst:
                if ratios[key] is not None and abs(ratios[key] - 1) > abs(worst[key] - 1):
                    worst[key] = ratios[key]
            lines.append(f"| {r['rate']:g} | {r['shape']} | {_f(a['tok_s'])} | {_f(ratios['tok_s'], '.3f')} | "
                         f"{_f(a['p50_ttft_ms'], '.0f')} | {_f(ratios['p50_ttft_ms'], '.3f')} | "
                         f"{_f(a['p50_tpot_ms'], '.1f')} | {_f(ratios['p50_tpot_ms'], '.3f')} | "
                         f"{_f(100 * a['goodput_fraction'], '.0f')} | {_f(100 * b['goodput_fraction'], '.0f')} | "
                         f"{_f(a['kv_transfer_p50_ms'], '.2f')} |")
        lines += ["", f"Worst sim/real: throughput {worst['tok_s']:.3f}, p50 TTFT {worst['p50_ttft_ms']:.3f}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["sim", "real", "render"])
    parser.add_argument("--scales", default="16,64")
    parser.add_argument("--rates", default=None)
    parser.add_argument("--requests-per-replica", type=int, default=40)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--profile", default=None, help="real: a profile fitted before (skips calibration)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    out = Path(args.out)
    path = out.with_suffix(".json")
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    if args.part == "sim":
        args.rates = args.rates or "0.5,1,2,3,4"
        data["sim"] = simulate_gpu(args)
    elif args.part == "real":
        args.rates = args.rates or "0.2,0.35,0.5"
        data["real"] = measure_real(args, out)
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    out.write_text(report(data), encoding="utf-8")
    print(report(data))


if __name__ == "__main__":
    main()
