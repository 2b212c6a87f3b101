"""What serving over HTTP costs: one workload served in-process (``python -m nanovllm.run``) and through the
OpenAI-compatible server (``python -m nanovllm.serve``, driven by ``python -m nanovllm.run runner=http``), with
the same engine settings, side by side: output throughput and its ratio (goal: the server keeps at least 0.9x),
and the TTFT / ITL / TPOT / E2EL differences as each side measures them.

    python experiments/bench_server.py [--num-requests 64] [--input-len 64] [--output-len 64]
        [--request-rate inf] [--max-num-seqs 32] [--dtype bfloat16] [--engine-core 1] [--client-core 0]
        [--repeats 2] [--json FILE]

The engine gets one core and one thread in both runs (``--engine-core``): in-process, the run is alone on it;
over HTTP, the server process (engine thread, event loop, detokenization) is on it and the client on
``--client-core``, so the difference is what the server adds to the engine's own core. Prompts are token ids
with ``ignore_eos``, so both runs generate exactly the same number of tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from nanovllm import machine

REPO = Path(__file__).resolve().parent.parent
ROWS = [("output_throughput", "output tok/s"), ("mean_step_ms", "mean step ms"),
        ("median_step_gap_ms", "median gap between steps ms"), ("request_throughput", "requests/s"),
        ("mean_ttft_ms", "mean TTFT ms"), ("median_ttft_ms", "median TTFT ms"), ("p99_ttft_ms", "p99 TTFT ms"),
        ("mean_itl_ms", "mean ITL ms"), ("median_itl_ms", "median ITL ms"), ("mean_tpot_ms", "mean TPOT ms"),
        ("mean_e2el_ms", "mean E2EL ms"), ("duration", "duration s"), ("completed", "completed")]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return env


def _pinned(core: int, *command: str) -> list[str]:
    return ["taskset", "-c", str(core), sys.executable, *command]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, env=_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {what} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited ({proc.returncode}):\n{proc.communicate()[1][-3000:]}")
        with contextlib.suppress(httpx.HTTPError):  # not listening yet: ask again
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("error: the server never answered /health")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--request-rate", default="inf", help="requests/s (inf: all at once)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--engine-core", type=int, default=1)
    parser.add_argument("--client-core", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="alternating in-process / HTTP pairs")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    info = machine.describe(threads=1)
    print(machine.header(info=info), flush=True)

    engine = [f"engine.dtype={args.dtype}", f"engine.max_num_seqs={args.max_num_seqs}", "engine.num_kv_blocks=2048",
              "engine.max_model_len=2048", "monitor.calibrate=false", "progress=false"]
    workload = ["workload=synthetic", f"workload.num_requests={args.num_requests}",
                f"workload.request_rate={args.request_rate}", "workload.input_len.kind=fixed",
                f"workload.input_len.mean={args.input_len}", "workload.output_len.kind=fixed",
                f"workload.output_len.mean={args.output_len}", "workload.ignore_eos=true"]
    pairs = []
    for repeat in range(args.repeats):  # in-process and HTTP alternate: a shared machine drifts between runs
        with tempfile.TemporaryDirectory(prefix="bench_server_") as tmp:
            pairs.append(_pair(Path(tmp), engine, workload, args, repeat))

    print(f"\nworkload: {args.num_requests} requests, {args.input_len} prompt + {args.output_len} output tokens "
          f"(token ids, EOS ignored), rate {args.request_rate}/s; engine: {args.dtype}, max_num_seqs "
          f"{args.max_num_seqs}, one thread on core {args.engine_core}; client on core {args.client_core}; "
          f"{args.repeats} alternating repeat(s), the table is the last")
    in_process, client, server_side = pairs[-1]
    print("| metric | in-process | over HTTP (client side) | over HTTP (server side) | HTTP / in-process |")
    print("|---|---|---|---|---|")
    for key, label in ROWS:
        a, b, c = in_process.get(key), client.get(key), server_side.get(key)
        ratio = f"{b / a:.3f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else "n/a"
        print(f"| {label} | {_fmt(a)} | {_fmt(b)} | {_fmt(c)} | {ratio} |")
    ratios = [c["output_throughput"] / i["output_throughput"] for i, c, _ in pairs]
    print(f"\nthroughput kept over HTTP, each repeat: {', '.join(f'{r:.3f}x' for r in ratios)}; median "
          f"{statistics.median(ratios):.3f}x of in-process (goal >= 0.9x)")
    for i, c, _ in pairs:
        print(f"  in-process {i['output_throughput']:.2f} tok/s, HTTP {c['output_throughput']:.2f} tok/s; TTFT "
              f"{c['mean_ttft_ms'] - i['mean_ttft_ms']:+.1f} ms, ITL {c['mean_itl_ms'] - i['mean_itl_ms']:+.2f} ms "
              "(means, HTTP - in-process)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), "repeats": [
                {"in_process": i, "http_client": c, "http_server": s} for i, c, s in pairs],
                "throughput_ratios": ratios}, f, indent=2, default=str)


def _pair(tmp_dir: Path, engine: list[str], workload: list[str], args: argparse.Namespace,
          repeat: int) -> tuple[dict, dict, dict]:
    """One in-process run and one over HTTP: the metrics of the run, the client and the server."""
    print(f"[{repeat}] in-process: python -m nanovllm.run ...", flush=True)
    _run(_pinned(args.engine_core, "-m", "nanovllm.run", *engine, *workload,
                 f"hydra.run.dir={tmp_dir / 'in_process'}"), "the in-process run")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"[{repeat}] over HTTP: python -m nanovllm.serve on {url}, python -m nanovllm.run runner=http ...",
          flush=True)
    server = subprocess.Popen(_pinned(args.engine_core, "-m", "nanovllm.serve", *engine, f"server.port={port}",
                                      f"hydra.run.dir={tmp_dir / 'server'}"),
                              env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(url, server)
        _run(_pinned(args.client_core, "-m", "nanovllm.run", "runner=http", f"runner.url={url}/v1", *workload,
                     "progress=false", f"hydra.run.dir={tmp_dir / 'client'}"), "the runner=http run")
    finally:
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=120)
    in_process, client, server_side = (_metrics(tmp_dir / name) for name in ("in_process", "client", "server"))
    # Time the engine spends between two steps (admitting, turning tokens into records, text, chunks): the part
    # of the overhead that the machine's speed, which drifts on a shared machine, affects least.
    in_process["median_step_gap_ms"] = _median_step_gap_ms(tmp_dir / "in_process")
    server_side["median_step_gap_ms"] = _median_step_gap_ms(tmp_dir / "server")
    return in_process, client, server_side


def _median_step_gap_ms(run_dir: Path) -> float | None:
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines() if line.strip()]
    gaps = [b["start_time"] - a["start_time"] - a["duration"] for a, b in zip(steps, steps[1:])]
    return statistics.median(gaps) * 1000.0 if gaps else None


def _fmt(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
