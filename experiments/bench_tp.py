"""Tensor parallelism on this machine: the same greedy workload through TP=1 and TP=2, side by side in one process.

    python experiments/bench_tp.py [--prompts 8] [--max-tokens 32] [--repeats 2]

Three configurations: TP=1 with one torch thread, TP=1 with two threads (intra-op parallelism over the same
cores), and TP=2 with one thread per rank (the driver and one worker process, gloo all-reduces between them).
Prints tokens/s and the ratio to TP=1 / 1 thread, best of ``--repeats``, and whether the outputs agree.
"""

from __future__ import annotations

import argparse
import time

import torch

from nanovllm import LLM, SamplingParams, machine


def _best_time(llm: LLM, prompts: list[str], params: SamplingParams, repeats: int) -> tuple[float, list]:
    best, outputs = float("inf"), []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return best, [o.token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(machine.header(torch.get_num_threads()), flush=True)  # each row then sets its own threads
    prompts = [f"Write a short story about a robot named R{i} who learns to paint." for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    options = dict(num_kv_blocks=512, max_model_len=512)
    rows = []
    for label, tp, threads in (("TP=1, 1 thread", 1, 1), ("TP=1, 2 threads", 1, 2), ("TP=2, 1 thread/rank", 2, 1)):
        torch.set_num_threads(threads)
        llm = LLM(tensor_parallel_size=tp, **options)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm up
        seconds, tokens = _best_time(llm, prompts, params, args.repeats)
        if tp > 1:
            llm.engine.runner.close()
        rows.append((label, args.prompts * args.max_tokens / seconds, tokens))
        print(f"{label}: {rows[-1][1]:.1f} tokens/s", flush=True)
    base = rows[0][1]
    print(f"{args.prompts} prompts x {args.max_tokens} tokens, greedy float32, best of {args.repeats}")
    print("| configuration | tokens/s | ratio | same tokens as TP=1 |\n|---|---|---|---|")
    for label, rate, tokens in rows:
        print(f"| {label} | {rate:.1f} | {rate / base:.2f}x | {tokens == rows[0][2]} |")


if __name__ == "__main__":
    main()
