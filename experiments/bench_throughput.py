"""Offline throughput on a ShareGPT-like workload: nano-vllm vs transformers, same process, same dtype.

``--num-requests`` requests (default 256) with lognormal prompt and output lengths shaped like ShareGPT's
(long-tailed; scaled down by default so the run takes minutes on 2 cores), all submitted at once. nano-vllm
serves them with continuous batching; transformers runs them as static batches of ``--hf-batch-size`` in
submission order, each batch generating until its longest request is done (what a static batch must do).
Both count only the tokens each request asked for. EOS is ignored so both produce exactly those lengths.

    python experiments/bench_throughput.py [--num-requests 256] [--dtype bfloat16] [--input-mean 128]
                                           [--output-mean 64] [--hf-batch-size 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams, machine
from nanovllm.harness.workload import LengthDist, SyntheticWorkloadConfig, generate_workload


def sharegpt_like(llm: LLM, n: int, input_mean: float, output_mean: float, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs: text prompts, lognormal lengths (ShareGPT's shape: most short, a few
    long)."""
    cfg = SyntheticWorkloadConfig(
        num_requests=n, prompt_kind="text", seed=seed,
        input_len=LengthDist(kind="lognormal", mean=input_mean, sigma=0.9, min=4, max=8 * int(input_mean)),
        output_len=LengthDist(kind="lognormal", mean=output_mean, sigma=0.7, min=4, max=4 * int(output_mean)),
    )
    return [(r.prompt, r.max_tokens) for r in generate_workload(cfg, llm.tokenizer)]


def run_nanovllm(llm: LLM, requests: list[tuple[list[int], int]]) -> float:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outputs] == [m for _, m in requests]
    return elapsed


def run_transformers(model, requests: list[tuple[list[int], int]], batch_size: int, pad_id: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        longest = max(m for _, m in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        with torch.inference_mode():
            model.generate(input_ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--input-mean", type=float, default=128)
    parser.add_argument("--output-mean", type=float, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice, all cores); 1 is steadier on a busy machine")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine.describe(torch.get_num_threads())
    print(machine.header(info=info), flush=True)

    llm = LLM(dtype=args.dtype, max_num_seqs=args.max_num_seqs, num_kv_blocks=8192, max_model_len=2048)
    requests = sharegpt_like(llm, args.num_requests, args.input_mean, args.output_mean, args.seed)
    prompt_tokens = sum(len(p) for p, _ in requests)
    output_tokens = sum(m for _, m in requests)
    run_nanovllm(llm, requests[:4])  # warm-up
    ours_s = run_nanovllm(llm, requests)
    result = {"num_requests": args.num_requests, "dtype": args.dtype, "prompt_tokens": prompt_tokens,
              "output_tokens": output_tokens, "threads": torch.get_num_threads(),
              "nanovllm_s": ours_s, "nanovllm_output_tok_s": output_tokens / ours_s, "machine": info}
    print(f"workload: {args.num_requests} requests, {prompt_tokens} prompt + {output_tokens} output tokens "
          f"(lognormal, means {args.input_mean:.0f}/{args.output_mean:.0f}), {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    print(f"nano-vllm              {output_tokens / ours_s:8.1f} output tok/s  ({ours_s:.1f} s)")
    if not args.skip_transformers:
        model = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=getattr(torch, args.dtype)).eval()
        pad_id = llm.engine.hf_config.eos_token_id
        run_transformers(model, requests[:2], 2, pad_id)  # warm-up
        hf_s = run_transformers(model, requests, args.hf_batch_size, pad_id)
        result.update(transformers_s=hf_s, transformers_output_tok_s=output_tokens / hf_s, ratio=hf_s / ours_s)
        print(f"transformers (batch {args.hf_batch_size}) {output_tokens / hf_s:8.1f} output tok/s  ({hf_s:.1f} s)")
        print(f"ratio (nano-vllm / transformers): {hf_s / ours_s:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
