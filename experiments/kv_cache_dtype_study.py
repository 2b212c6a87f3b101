"""The 8-bit KV cache's effect on one saturating workload: the same ``kv_cache_memory``, the model-dtype cache
(``kv_cache_dtype=auto``) against ``int8``, on the real engine (default model, cpu attention kernel).

    python experiments/kv_cache_dtype_study.py [--dtype float32] [--memory-mib 48] [--requests 16]
                                               [--prompt-tokens 192] [--output-tokens 48]

Every request arrives at once (a burst), so the cache is the limit: with the model-dtype cache only a few requests
fit at a time and growing decodes preempt each other; the int8 cache holds ~1.9x the blocks (one byte per value
plus a float32 scale per token and KV head). Reports blocks, preemptions, median / p99 TTFT and output throughput,
and writes ``experiments/results/kv_cache_dtype.md`` and ``.json``. Pin it to one core for steady numbers
(``OMP_NUM_THREADS=1 taskset -c 1``); float32 is the default model dtype because on an AVX2-only CPU it ran faster
than bfloat16 when this study was set up.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanovllm import machine  # noqa: E402

OUT = ROOT / "experiments" / "results" / "kv_cache_dtype.md"
CACHE_DTYPES = ("auto", "int8")


def run_one(args: argparse.Namespace, kv_cache_dtype: str) -> dict:
    """One run of the burst with ``kv_cache_dtype``; the summary figures of the row."""
    import torch

    from nanovllm.config import EngineConfig
    from nanovllm.harness.serving import ServedEngine
    from nanovllm.harness.workload import WorkloadRequest

    torch.set_num_threads(1)
    config = EngineConfig(dtype=args.dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=args.memory_mib * 2**20,
                          max_num_seqs=args.requests, max_model_len=1024, seed=0)
    served = ServedEngine.build(config, attention="cpu")
    rng = random.Random(0)
    workload = [WorkloadRequest(arrival_time=0.0, prompt=[rng.randrange(10, 40000) for _ in range(args.prompt_tokens)],
                                max_tokens=args.output_tokens, ignore_eos=True) for _ in range(args.requests)]
    result = served.serve(workload, progress=False)
    s = result.summary
    return {"kv_cache_dtype": kv_cache_dtype, "num_kv_blocks": served.engine.num_kv_blocks,
            "block_bytes": served.engine.kv_block_bytes, "completed": s["completed"],
            "num_preemptions": s["num_preemptions"], "recomputed_tokens": s["recomputed_tokens"],
            "peak_running": max(step["num_running"] for step in result.steps),
            "median_ttft_ms": s["median_ttft_ms"], "p99_ttft_ms": s["p99_ttft_ms"],
            "output_throughput": s["total_output_tokens"] / result.wall_time, "wall_time_s": result.wall_time}


def report(data: dict) -> str:
    lines = [
        "# KV-cache dtype: the same memory, model-dtype vs 8-bit cache",
        "",
        f"Command: `{data['command']}`",
        "",
        data["header"],
        "",
        f"Model SmolLM2-135M in {data['dtype']}, attention=cpu, kv_cache_memory={data['memory_mib']} MiB; "
        f"{data['requests']} requests of {data['prompt_tokens']} prompt + {data['output_tokens']} output tokens, "
        "all arriving at once.",
        "",
        "| kv_cache_dtype | blocks | block bytes | peak running | preemptions | recomputed tokens | median TTFT ms "
        "| p99 TTFT ms | output tok/s |",
        "|" + "---|" * 9,
    ]
    for r in data["rows"]:
        lines.append(f"| {r['kv_cache_dtype']} | {r['num_kv_blocks']} | {r['block_bytes']} | {r['peak_running']} | "
                     f"{r['num_preemptions']} | {r['recomputed_tokens']} | {r['median_ttft_ms']:.0f} | "
                     f"{r['p99_ttft_ms']:.0f} | {r['output_throughput']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--memory-mib", type=int, default=48)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=192)
    parser.add_argument("--output-tokens", type=int, default=48)
    args = parser.parse_args()
    command = "OMP_NUM_THREADS=1 taskset -c 1 python experiments/kv_cache_dtype_study.py " + " ".join(sys.argv[1:])
    rows = [run_one(args, kv) for kv in CACHE_DTYPES]
    data = {"command": command.strip(), "header": machine.header(1), "machine": machine.describe(1),
            "dtype": args.dtype, "memory_mib": args.memory_mib, "requests": args.requests,
            "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "rows": rows}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(report(data))
    OUT.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    print(report(data))


if __name__ == "__main__":
    main()
