"""Throughput floor: nano-vllm vs transformers ``generate`` (a left-padded static batch) in one process.

The same chat prompts (greedy, ``--max-tokens`` new tokens each, EOS ignored so both produce exactly the same
number of tokens), the same dtype and weights. Prints tokens/s of each and the ratio, and checks that the
greedy tokens agree (for float32, where they must).

    python experiments/bench_vs_hf.py [--num-prompts 32] [--max-tokens 64] [--dtype float32] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.harness.workload import load_chat_prompts


def chat_prompts(llm: LLM, n: int) -> list[list[int]]:
    conversations = load_chat_prompts()
    return [llm.apply_chat_template(conversations[i % len(conversations)]) for i in range(n)]


def run_nanovllm(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.token_ids for o in outputs]


def run_transformers(model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> tuple[float, list[list[int]]]:
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - start, out[:, width:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each (best is reported)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()

    llm = LLM(dtype=args.dtype, num_kv_blocks=2048, max_model_len=2048)
    prompts = chat_prompts(llm, args.num_prompts)
    model = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=getattr(torch, args.dtype)).eval()
    pad_id = llm.engine.hf_config.eos_token_id
    total = args.num_prompts * args.max_tokens
    # Warm both up once on a small batch so one-time costs (allocator, first-call dispatch) are not timed.
    run_nanovllm(llm, prompts[:2], 4)
    run_transformers(model, prompts[:2], 4, pad_id)
    ours_s, ours_tokens = min((run_nanovllm(llm, prompts, args.max_tokens) for _ in range(args.repeats)),
                              key=lambda r: r[0])
    hf_s, hf_tokens = min((run_transformers(model, prompts, args.max_tokens, pad_id) for _ in range(args.repeats)),
                          key=lambda r: r[0])
    agree = sum(a == b for a, b in zip(ours_tokens, hf_tokens))
    result = {
        "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "nanovllm_tok_s": total / ours_s, "transformers_tok_s": total / hf_s, "ratio": hf_s / ours_s,
        "identical_outputs": f"{agree}/{args.num_prompts}",
    }
    print(f"workload: {args.num_prompts} chat prompts, {args.max_tokens} new tokens each (greedy), "
          f"{args.dtype}, {torch.get_num_threads()} threads")
    print(f"nano-vllm          {result['nanovllm_tok_s']:8.1f} tok/s  ({ours_s:.2f} s)")
    print(f"transformers batch {result['transformers_tok_s']:8.1f} tok/s  ({hf_s:.2f} s)")
    print(f"ratio (nano-vllm / transformers): {result['ratio']:.2f}x   identical outputs: {agree}/{args.num_prompts}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
