"""Vidur side by side with nano-vllm's simulator: the same trace, model, GPU operator table and scheduler family.

    python experiments/sim_vs_vidur.py [--requests 2000] [--rate 8] [--chunk 512] [--max-batch 128]
        [--vidur-python /root/vidur-venv/bin/python] [--keep DIR]

Vidur (``pip install vidur==0.0.26`` in its own venv) downloads its operator profiles from Hugging Face datasets at
run time. Offline, this script writes a local Hugging Face cache snapshot holding a SYNTHETIC operator table in
Vidur's format (``mlp.csv.xz``, ``attention.csv.xz`` and a ``config.json`` naming model and device, plus the network
dataset's ``config.json``) and runs Vidur with ``HF_HUB_OFFLINE=1``. nano-vllm's ``profiled`` step-time model reads
the very same table (plain ``mlp.csv`` / ``attention.csv``), so both simulators price the same operators and what
differs is how each one uses them (interpolation vs a fitted random forest, batching of attention, scheduling).
No third-party data is read or written: the table is a roofline of an H100 running Llama-3-8B, made up here.

Both are run on one trace (Poisson arrivals, random prompt and output lengths) written in the two CSV layouts:
Splitwise/Vidur's ``arrived_at,num_prefill_tokens,num_decode_tokens`` (nano-vllm's ``workload.format=vidur``) and
the ``Date,Time,PromptTokenCount,CompletionTokenCount`` layout that Vidur 0.0.26's ``trace_replay`` generator reads.
Two scheduler pairs: vLLM-like (whole prefills first, up to ``--max-tokens`` tokens a step: Vidur ``vllm``,
nano-vllm ``prefill_first`` without chunking) and Sarathi-like (decodes first, prefills chunked into a budget of
``--chunk`` tokens: Vidur ``sarathi``, nano-vllm ``fcfs`` with chunked prefill), both capped at ``--max-batch``.
"""

from __future__ import annotations

import argparse
import csv
import json
import lzma
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

REPO = Path(__file__).resolve().parent.parent
VIDUR_MODEL = "meta-llama/Llama-3-8B"   # Vidur's name for Meta-Llama-3-8B's shape (its model_config.py)
OUR_MODEL = str(REPO / "nanovllm/data/models/llama-3-8b")  # the same architecture's config.json
DEVICE, NETWORK = "h100", "h100_dgx"   # Vidur's device / node SKU names
COMPUTE_DATASET, NETWORK_DATASET = "local/synthetic-llama-3-8b-h100", "local/synthetic-h100-dgx"
SNAPSHOT = "0" * 40                    # any commit hash: the offline cache resolves refs/main to it

# Llama-3-8B's shape, as both Vidur's model config and the config.json above give it.
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 4096, 14336, 32, 8, 128256
HEAD_DIM = HIDDEN // HEADS

# The synthetic H100: effective (not peak) bf16 matmul rate and memory bandwidth, and a kernel launch floor.
# Made-up round numbers of the right order; they are the same for both simulators, which is what matters here.
MATMUL_FLOPS = 600e12
ATTN_FLOPS = 400e12
BANDWIDTH = 2.8e12
LAUNCH_MS = 0.005
TOKEN_POINTS = sorted({1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
                       *range(8, 4097, 248)})


def _roofline_ms(flops: float, nbytes: float, flops_rate: float = MATMUL_FLOPS) -> float:
    """A kernel's time: the slower of compute and memory traffic, plus its launch."""
    return LAUNCH_MS + 1e3 * max(flops / flops_rate, nbytes / BANDWIDTH)


def layer_op_ms(op: str, tokens: int) -> float:
    """One layer's operator at ``tokens`` tokens, one GPU, bf16: a matmul reads its weights once and does
    2 x tokens x weights FLOPs; an elementwise operator reads and writes the activations."""
    matmuls = {"attn_pre_proj": HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM, "attn_post_proj": HIDDEN * HIDDEN,
               "mlp_up_proj": HIDDEN * 2 * FFN, "mlp_down_proj": FFN * HIDDEN}
    if op in matmuls:
        w = matmuls[op]
        return _roofline_ms(2.0 * tokens * w, 2.0 * (w + tokens * HIDDEN))
    width = {"mlp_act": 3 * FFN, "attn_rope": 2 * (HEADS + KV_HEADS) * HEAD_DIM, "emb": 2 * HIDDEN}.get(op, 3 * HIDDEN)
    return _roofline_ms(0.0, 2.0 * tokens * width)


def prefill_attention_ms(chunk: int, cached: int, batch: int = 1) -> float:
    """Causal attention of ``batch`` chunks of ``chunk`` new tokens after ``cached`` ones: 4 x head_dim x heads
    FLOPs per (query, key) pair, the pairs nano-vllm's reader counts; reads the cached K/V once."""
    pairs = batch * (chunk * cached + chunk * (chunk + 1) / 2)
    kv_bytes = batch * (cached + chunk) * 2 * KV_HEADS * HEAD_DIM * 2
    return _roofline_ms(4.0 * HEAD_DIM * HEADS * pairs, kv_bytes, ATTN_FLOPS)


def decode_attention_ms(batch: int, kv_tokens: int) -> float:
    """``batch`` decodes each reading ``kv_tokens`` cached tokens' K and V (bandwidth-bound)."""
    return _roofline_ms(4.0 * HEAD_DIM * HEADS * batch * kv_tokens, batch * kv_tokens * 2 * KV_HEADS * HEAD_DIM * 2,
                        ATTN_FLOPS)


MLP_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj", "mlp_act", "input_layernorm",
           "post_attention_layernorm", "attn_rope", "add", "emb")


def mlp_rows() -> list[dict[str, Any]]:
    """Vidur's mlp.csv: the model shape columns both readers filter on, then one time per operator."""
    shape = {"n_head": HEADS, "n_kv_head": KV_HEADS, "n_embd": HIDDEN, "n_expanded_embd": FFN,
             "use_gated_mlp": True, "vocab_size": VOCAB, "num_tensor_parallel_workers": 1}
    return [{**shape, "num_tokens": t, **{f"time_stats.{op}.median": round(layer_op_ms(op, t), 6) for op in MLP_OPS}}
            for t in TOKEN_POINTS]


def attention_rows(max_len: int = 4096, block_size: int = 16) -> list[dict[str, Any]]:
    """Vidur's attention.csv: prefill rows (``prefill_chunk_size`` > 0, batch 1, as Vidur predicts them) and
    decode rows (``prefill_chunk_size`` 0); ``is_prefill`` for nano-vllm's reader."""
    shape = {"n_embd": HIDDEN, "n_q_head": HEADS, "n_kv_head": KV_HEADS, "block_size": block_size,
             "num_tensor_parallel_workers": 1}
    rows = []
    for chunk in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        for cached in range(0, max_len - chunk + 1, 256):
            rows.append({**shape, "batch_size": 1, "prefill_chunk_size": chunk, "kv_cache_size": cached,
                         "is_prefill": True, "time_stats.attn_prefill.median": round(
                             prefill_attention_ms(chunk, cached), 6), "time_stats.attn_decode.median": "",
                         "time_stats.attn_kv_cache_save.median": round(layer_op_ms("add", chunk), 6)})
    for batch in (1, 2, 4, 8, 16, 32, 64, 96, 128):
        for kv in (16, 64, 256, 512, 1024, 2048, 3072, 4096):
            rows.append({**shape, "batch_size": batch, "prefill_chunk_size": 0, "kv_cache_size": kv,
                         "is_prefill": False, "time_stats.attn_prefill.median": "",
                         "time_stats.attn_decode.median": round(decode_attention_ms(batch, kv), 6),
                         "time_stats.attn_kv_cache_save.median": round(layer_op_ms("add", batch), 6)})
    return rows


def _write_csv(path: Path, rows: Sequence[dict[str, Any]], xz: bool = False) -> None:
    opener = lzma.open if xz else open
    with opener(path, "wt", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _hf_snapshot(cache: Path, repo_id: str, files: dict[str, Any]) -> None:
    """A Hugging Face hub cache entry that ``snapshot_download(repo_id, repo_type="dataset", cache_dir=cache)``
    resolves offline: ``datasets--org--name/refs/main`` naming a snapshot directory holding the files."""
    root = cache / ("datasets--" + repo_id.replace("/", "--"))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(SNAPSHOT)
    snap = root / "snapshots" / SNAPSHOT
    snap.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if name.endswith(".json"):
            (snap / name).write_text(json.dumps(content))
        else:
            _write_csv(snap / name, content, xz=name.endswith(".xz"))


def write_profiles(work: Path) -> tuple[Path, Path]:
    """The synthetic table twice: plain CSVs for nano-vllm (``runner.profile``) and Vidur's offline HF cache.
    Returns (nano-vllm profile dir, Vidur predictor cache dir)."""
    mlp, attn = mlp_rows(), attention_rows()
    ours = work / "profile"
    ours.mkdir(parents=True, exist_ok=True)
    _write_csv(ours / "mlp.csv", mlp)
    _write_csv(ours / "attention.csv", attn)
    vidur_cache = work / "vidur_cache"
    _hf_snapshot(vidur_cache / "profiling_data" / "compute", COMPUTE_DATASET,
                 {"config.json": {"model": VIDUR_MODEL, "device_sku": DEVICE}, "mlp.csv.xz": mlp,
                  "attention.csv.xz": attn})
    # Only read for tensor / pipeline parallelism (not used here), but its config.json is checked.
    _hf_snapshot(vidur_cache / "profiling_data" / "network", NETWORK_DATASET, {"config.json": {"sku": NETWORK}})
    return ours, vidur_cache


@dataclass(frozen=True)
class Request:
    arrived_at: float
    prefill: int
    decode: int


def make_trace(n: int, rate: float, seed: int, max_len: int = 4096) -> list[Request]:
    """Poisson arrivals; lognormal prompt (median ~600) and output (median ~150) lengths, within ``max_len``
    together (Vidur's Llama-3-8B has max_model_len 4096)."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    t -= t[0]
    p = np.clip(rng.lognormal(np.log(600), 0.8, n), 16, 3000).astype(int)
    d = np.clip(rng.lognormal(np.log(150), 0.8, n), 4, max_len - p).astype(int)
    return [Request(float(a), int(b), int(c)) for a, b, c in zip(t, p, d)]


def write_traces(work: Path, trace: Sequence[Request]) -> tuple[Path, Path]:
    """(Splitwise/Vidur-processed layout for nano-vllm, Vidur 0.0.26's trace_replay layout)."""
    ours, theirs = work / "trace_splitwise.csv", work / "trace_vidur_replay.csv"
    _write_csv(ours, [{"arrived_at": f"{r.arrived_at:.6f}", "num_prefill_tokens": r.prefill,
                       "num_decode_tokens": r.decode} for r in trace])
    _write_csv(theirs, [{"Date": "2023-08-21", "Time": f"{r.arrived_at:.6f}", "PromptTokenCount": r.prefill,
                         "CompletionTokenCount": r.decode} for r in trace])
    return ours, theirs


@dataclass
class Result:
    wall_s: float
    n: int
    ttft: np.ndarray   # seconds
    tpot: np.ndarray
    e2e: np.ndarray
    makespan: float    # first arrival to last finish, simulated seconds
    output_tokens: int
    note: str = ""


def run_vidur(python: str, work: Path, trace_csv: Path, trace: Sequence[Request], cache: Path, scheduler: str,
              args: Any) -> Result:
    """Vidur in its own interpreter, offline; wall time is the whole process (predictor training included,
    as a user pays it; the trained table is cached in ``cache`` across runs of the same config)."""
    out = work / f"vidur_out_{scheduler}"
    rf = "random_forrest_execution_time_predictor_config"
    cmd = [python, "-m", "vidur.main", "--log_level", "warning",
           "--replica_config_model_name", VIDUR_MODEL, "--replica_config_device", DEVICE,
           "--replica_config_network_device", NETWORK, "--replica_config_tensor_parallel_size", "1",
           "--replica_config_num_pipeline_stages", "1", "--cluster_config_num_replicas", "1",
           "--request_generator_config_type", "trace_replay",
           "--trace_request_generator_config_trace_file", str(trace_csv),
           "--trace_request_generator_config_date", "2023-08-21",
           "--trace_request_generator_config_prefill_scale_factor", "1",
           "--trace_request_generator_config_decode_scale_factor", "1",
           "--trace_request_generator_config_time_scale_factor", "1",
           "--trace_request_generator_config_max_tokens", "4096",
           "--replica_scheduler_config_type", scheduler,
           "--execution_time_predictor_config_type", "random_forrest",
           f"--{rf}_model_profiling_dataset", COMPUTE_DATASET, f"--{rf}_network_profiling_dataset", NETWORK_DATASET,
           f"--{rf}_cache_dir", str(cache), f"--{rf}_prediction_max_tokens_per_request", "4096",
           f"--{rf}_prediction_max_batch_size", str(args.max_batch),
           # Vidur's default grid (27 forests x 10 folds per operator) takes far longer than the simulation on
           # one core; one forest, 3 folds, one thread.
           f"--{rf}_num_estimators", "64", f"--{rf}_max_depth", "16", f"--{rf}_min_samples_split", "2",
           f"--{rf}_k_fold_cv_splits", "3", f"--{rf}_num_training_job_threads", "1",
           # 0.1 by default for GQA models: a 10% surcharge on batched decode attention that nano-vllm's
           # table lookup does not add; off so that both price the same table.
           f"--{rf}_attention_decode_batching_overhead_fraction", "0",
           "--metrics_config_output_dir", str(out), "--no-metrics_config_store_plots",
           "--no-metrics_config_enable_chrome_trace", "--no-metrics_config_write_json_trace",
           "--no-metrics_config_store_batch_metrics", "--no-metrics_config_store_utilization_metrics"]
    if scheduler == "vllm":
        cmd += ["--vllm_scheduler_config_batch_size_cap", str(args.max_batch),
                "--vllm_scheduler_config_max_tokens_in_batch", str(args.max_tokens)]
    else:
        cmd += ["--sarathi_scheduler_config_batch_size_cap", str(args.max_batch),
                "--sarathi_scheduler_config_chunk_size", str(args.chunk)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"Vidur failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    metrics = sorted(out.glob("*/request_metrics.csv"))
    if not metrics:
        raise RuntimeError(f"Vidur wrote no request_metrics.csv under {out}:\n{proc.stderr[-2000:]}")
    with metrics[-1].open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    col = lambda name: np.asarray([float(r[name]) for r in rows])  # noqa: E731
    e2e, ttft = col("request_e2e_time"), col("prefill_e2e_time")
    decodes = col("request_num_decode_tokens")
    # TPOT as nano-vllm counts it: the time after the first token over the tokens after the first.
    tpot = (e2e - ttft) / np.maximum(decodes - 1, 1)
    # request_metrics.csv has no arrival time; its "Request Id" is the trace row (Vidur numbers requests in
    # arrival order), so the arrival comes from the trace itself.
    arrived = np.asarray([trace[int(r["Request Id"])].arrived_at for r in rows])
    makespan = float(np.max(arrived + e2e) - np.min(arrived))
    return Result(wall, len(rows), ttft, tpot, e2e, makespan, int(decodes.sum()))


def run_ours(profile: Path, trace_csv: Path, scheduler: str, args: Any) -> Result:
    """nano-vllm's simulator in this process, ``profiled`` step time on the synthetic table; wall time is
    ``serve`` alone plus building the engine (no training step exists)."""
    import yaml

    from nanovllm.config import EngineConfig
    from nanovllm.harness.sim import Hardware, Simulation
    from nanovllm.harness.workload import generate_workload
    from nanovllm.harness.workload.config import TraceWorkloadConfig

    hardware = Hardware.from_config(yaml.safe_load((REPO / "conf/hardware/h100_sxm.yaml").read_text()))
    vllm_like = scheduler == "vllm"
    config = EngineConfig(model=OUR_MODEL, dtype="bfloat16", max_num_seqs=args.max_batch,
                          max_num_batched_tokens=args.max_tokens if vllm_like else args.chunk,
                          enable_chunked_prefill=not vllm_like,
                          max_model_len=4096)  # Vidur's Llama-3-8B max_model_len (the trace keeps within it)
    start = time.perf_counter()
    sim = Simulation.build(config, "profiled", profile=str(profile), hardware=hardware,
                           scheduler="prefill_first" if vllm_like else "fcfs")
    workload = generate_workload(TraceWorkloadConfig(path=str(trace_csv), format="vidur"), sim.engine.tokenizer)
    result = sim.serve(workload)
    wall = time.perf_counter() - start
    done = [r for r in result.requests if r["finish_time"] is not None and r["first_token_time"] is not None]
    arrival = np.asarray([r["arrival_time"] for r in done])
    first = np.asarray([r["first_token_time"] for r in done])
    finish = np.asarray([r["finish_time"] for r in done])
    outs = np.asarray([r["num_output_tokens"] for r in done])
    tpot = (finish - first) / np.maximum(outs - 1, 1)
    note = f"{len(result.requests) - len(done)} not finished" if len(done) < len(result.requests) else ""
    return Result(wall, len(done), first - arrival, tpot, finish - arrival,
                  float(finish.max() - arrival.min()), int(outs.sum()), note)


def _pct(a: np.ndarray, q: float, scale: float = 1e3) -> str:
    return f"{np.percentile(a, q) * scale:.1f}" if len(a) else "-"


def table(results: dict[str, Result]) -> str:
    """One column per (simulator, scheduler), one row per quantity; latencies in ms."""
    names = list(results)
    rs = list(results.values())  # lists, not generators: a generator would see the loop's last metric
    rows: list[tuple[str, list[str]]] = [
        ("requests simulated", [str(r.n) for r in rs]),
        ("wall ms / request", [f"{1e3 * r.wall_s / max(r.n, 1):.2f}" for r in rs]),
        ("wall s (total)", [f"{r.wall_s:.1f}" for r in rs]),
    ]
    for metric in ("ttft", "tpot", "e2e"):
        for q in (50, 90, 99):
            rows.append((f"{metric.upper()} p{q} ms", [_pct(getattr(r, metric), q) for r in rs]))
    rows.append(("throughput req/s", [f"{r.n / r.makespan:.2f}" for r in rs]))
    rows.append(("output tok/s", [f"{r.output_tokens / r.makespan:.0f}" for r in rs]))
    lines = ["| quantity | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return "\n".join(lines)


DIFFERENCES = """What differs and why (same trace, same Llama-3-8B shape, same synthetic H100 operator table):
- Operator times. nano-vllm interpolates the table linearly (held below the first point, proportional above the
  last); Vidur fits a random forest per operator (here 64 trees, depth 16) and predicts a dense grid from it, so
  between and beyond the measured points it is piecewise constant. Vidur rounds a step's token count, prefill
  chunk sizes (to 32) and KV lengths (to --kv-cache-prediction-granularity, 256) up before the lookup.
- Attention. nano-vllm prices prefill attention by the step's (query, key) pairs and decode attention by the sum
  of the KV tokens read (both from the engine's step features). Vidur prices each prefill chunk separately at
  (KV length rounded up, chunk) and all decodes as one batch at their mean KV length rounded up to 256; its 10%
  GQA decode-batching surcharge is turned off here so both read the same table.
- Whole step. nano-vllm adds hardware.step_overhead (2 ms a step in conf/hardware/h100_sxm.yaml: CPU
  scheduling, launches, sampling) and an analytical LM head (2 x hidden x vocab FLOPs per sampled row) to the table; Vidur 0.0.26
  prices only the profiled operators (no LM head, no CPU overhead in this version) and attn_kv_cache_save.
- Scheduling. vLLM-like: both run whole prefills first within the token cap and decode otherwise; Vidur's vllm
  scheduler admits while KV blocks, the token cap and the batch cap allow, and preempts by recomputation. Sarathi-
  like: both give running decodes their token first and fill the rest of the chunk budget with prefill chunks;
  Vidur's sarathi scheduler waits for the running batch to finish (one stage), as nano-vllm's engine does.
- Memory. Vidur sizes the KV cache from its H100 SKU (80 GB x gpu_memory_utilization 0.8 minus weights);
  nano-vllm from conf/hardware/h100_sxm.yaml's memory minus the weights. At this load neither runs out.
- Wall time. Vidur's includes starting Python, importing pandas/sklearn and (first run of a config) training and
  predicting its forests; later runs reuse the cached table. nano-vllm's includes building the engine and
  tokenizing random prompts (the simulator runs the real scheduler and block allocator on token ids).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrival rate, requests/s")
    parser.add_argument("--chunk", type=int, default=512, help="Sarathi-like token budget / chunk size")
    parser.add_argument("--max-tokens", type=int, default=4096, help="vLLM-like tokens per step at most")
    parser.add_argument("--max-batch", type=int, default=128, help="running requests at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vidur-python", default="/root/vidur-venv/bin/python")
    parser.add_argument("--keep", help="write the profiles, traces and Vidur output here (default: a temp dir)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        profile, cache = write_profiles(work)
        trace = make_trace(args.requests, args.rate, args.seed)
        ours_csv, vidur_csv = write_traces(work, trace)
        print(f"{args.requests} requests, Poisson {args.rate}/s, Llama-3-8B on a synthetic H100 table; "
              f"vLLM-like cap {args.max_tokens} tokens, Sarathi-like chunk {args.chunk}, batch <= {args.max_batch}",
              flush=True)
        results: dict[str, Result] = {}
        errors: list[str] = []
        for scheduler in ("vllm", "sarathi"):
            label = "vLLM-like" if scheduler == "vllm" else "Sarathi-like"
            try:
                results[f"Vidur {label}"] = run_vidur(args.vidur_python, work, vidur_csv, trace, cache, scheduler, args)
            except (RuntimeError, OSError) as e:
                errors.append(f"Vidur {label}: {e}")
            results[f"nano-vllm {label}"] = run_ours(profile, ours_csv, scheduler, args)
        print(table(results))
        for name, r in results.items():
            if r.note:
                print(f"{name}: {r.note}")
        for error in errors:
            print(error, file=sys.stderr)
        print()
        print(DIFFERENCES)


if __name__ == "__main__":
    main()
