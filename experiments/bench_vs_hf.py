"""Throughput floor: nano-vllm vs transformers ``generate`` (a left-padded static batch) in one process, in
bfloat16 and float32 side by side, plus batch-1 decode latency.

The same chat prompts (greedy, ``--max-tokens`` new tokens each, EOS ignored so both produce exactly the same
number of tokens), the same weights (transformers loads our dense cached HF copy, not the GGUF). Each row
compares like with like, nano-vllm against transformers in the same dtype. Rows (``--paths``):

- ``bfloat16``: nano-vllm's default, the fast path (fused, prepacked projections, fused C++ kernels);
- ``float32``: nano-vllm's exact reference path (unfused projections, token-identical to transformers);
- ``float32-fast``: the fast path in float32 (``fuse_projections=True``: fused, prepacked weights), held
  to vLLM's closeness standard like every fast path, as vLLM's own float32 is;
- ``int8-bf16`` / ``gguf-bf16``: quantized weights with bfloat16 activations (``quantization="int8"``: W8A8 with
  per-channel weight scales; ``"gguf"``: the GGUF file's own Q4_1 blocks), against transformers' dense bf16
  (the quantized standard, ``python -m nanovllm.validate --quantization``, holds them to account).

Prints tokens/s, the ratios, nano-vllm's bf16/fp32 speed-up, ms per decoded token at batch 1 (one prompt; the
decode part, prefill excluded), and the run's GEMM floor: nano-vllm's own matmuls for every step it took,
timed alone (``nanovllm.profile.run_gemm_floor``). The floor bounds what any engine using the same matmul
library can reach on this workload: ``floor tok/s`` and ``floor / transformers`` are that bound.

    python experiments/bench_vs_hf.py [--num-prompts 32] [--max-tokens 64] [--paths bfloat16,float32,float32-fast]
                                      [--repeats 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams, machine
from nanovllm.harness.workload import load_chat_prompts
from nanovllm.models.loader import resolve_model
from nanovllm.profile import run_gemm_floor

# Row name -> (dtype, fuse_projections, quantization): None is nano-vllm's default for the dtype.
PATHS = {"bfloat16": ("bfloat16", None, None), "float32": ("float32", None, None),
         "float32-fast": ("float32", True, None), "int8-bf16": ("bfloat16", None, "int8"),
         "gguf-bf16": ("bfloat16", None, "gguf")}


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


def batch1_decode_ms(generate_one, prompt: list[int], max_tokens: int, repeats: int = 1) -> float:
    """ms per decoded token for one prompt: (time for max_tokens - time for 1 token) / (max_tokens - 1), the
    fastest of ``repeats`` full runs (interference only ever adds time)."""
    generate_one(prompt, 2)  # warm-up
    short = min(_timed(lambda: generate_one(prompt, 1)) for _ in range(2))
    full = min(_timed(lambda: generate_one(prompt, max_tokens)) for _ in range(repeats))
    return (full - short) / (max_tokens - 1) * 1e3


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_path(path: str, num_prompts: int, max_tokens: int, repeats: int, keep_outputs: bool = False) -> dict:
    """Both engines on the same prompts, nano-vllm on ``path`` (a key of ``PATHS``), transformers in its dtype.
    ``keep_outputs`` adds the prompts, nano-vllm's outputs, the model directory and the engine (for a third engine
    to run the same thing, and for timed rounds after this one: bench_vs_vllm.py)."""
    dtype, fuse, quantization = PATHS[path]
    llm = LLM(dtype=dtype, num_kv_blocks=2048, max_model_len=2048, fuse_projections=fuse, quantization=quantization)
    prompts = chat_prompts(llm, num_prompts)
    dense_dir = resolve_model(llm.engine.config.model)  # transformers (and vLLM) read the dense weights
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=getattr(torch, dtype)).eval()
    pad_id = llm.engine.hf_config.eos_token_id
    total = num_prompts * max_tokens
    # Warm both up on the whole workload once, untimed, so one-time costs (allocator pages, first-call dispatch,
    # oneDNN primitives for each shape) are not timed: after a small warm-up batch the first full run in a process
    # still measured slower than later ones.
    run_nanovllm(llm, prompts, max_tokens)
    run_transformers(model, prompts, max_tokens, pad_id)
    ours_s, ours_tokens = min((run_nanovllm(llm, prompts, max_tokens) for _ in range(repeats)), key=lambda r: r[0])
    floor_s, _ = run_gemm_floor(llm.engine.runner.model, llm.last_steps, llm.engine.runner.dtype)
    hf_s, hf_tokens = min((run_transformers(model, prompts, max_tokens, pad_id) for _ in range(repeats)),
                          key=lambda r: r[0])
    ours_b1 = batch1_decode_ms(lambda p, n: run_nanovllm(llm, [p], n), prompts[0], max_tokens)
    hf_b1 = batch1_decode_ms(lambda p, n: run_transformers(model, [p], n, pad_id), prompts[0], max_tokens)
    extra = {"prompts": prompts, "nanovllm_outputs": ours_tokens, "model_dir": str(dense_dir), "llm": llm}
    return {
        **(extra if keep_outputs else {}),
        "path": path, "dtype": dtype, "quantization": quantization, "nanovllm_tok_s": total / ours_s, "transformers_tok_s": total / hf_s,
        "gemm_floor_s": floor_s, "floor_tok_s": total / floor_s, "nanovllm_s": ours_s,
        "ratio": hf_s / ours_s, "identical_outputs": sum(a == b for a, b in zip(ours_tokens, hf_tokens)),
        "nanovllm_batch1_ms_per_token": ours_b1, "transformers_batch1_ms_per_token": hf_b1,
        "attention": llm.engine.runner.backend.registered_name, "fast_path": llm.engine.config.fast_path,
    }


def parse_paths(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The ``--paths`` list, or a parser error naming the unknown row."""
    paths = [p for p in text.split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if not paths or unknown:
        parser.error(f"--paths must list some of {', '.join(PATHS)}, got {text!r}")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--paths", default="bfloat16,float32,float32-fast",
                        help=f"comma-separated rows: {', '.join(PATHS)}")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each (best is reported)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice, all cores); 1 is steadier on a busy machine")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = parse_paths(parser, args.paths)
    info = machine.describe(torch.get_num_threads())
    print(machine.header(info=info), flush=True)
    results = [bench_path(p, args.num_prompts, args.max_tokens, args.repeats) for p in paths]
    print(f"workload: {args.num_prompts} chat prompts, {args.max_tokens} new tokens each (greedy), "
          f"{torch.get_num_threads()} threads, one process")
    print("| path | nano-vllm tok/s | transformers tok/s | ratio | batch-1 ms/token nano-vllm | "
          "batch-1 ms/token transformers | identical outputs | GEMM floor tok/s | floor / transformers | "
          "nano-vllm / floor time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['path']} | {r['nanovllm_tok_s']:.1f} | {r['transformers_tok_s']:.1f} | {r['ratio']:.2f}x | "
              f"{r['nanovllm_batch1_ms_per_token']:.1f} | {r['transformers_batch1_ms_per_token']:.1f} | "
              f"{r['identical_outputs']}/{args.num_prompts} | {r['floor_tok_s']:.1f} | "
              f"{r['floor_tok_s'] / r['transformers_tok_s']:.2f}x | {r['nanovllm_s'] / r['gemm_floor_s']:.2f}x |")
    by_path = {r["path"]: r for r in results}
    for fp32 in ("float32", "float32-fast"):
        if "bfloat16" in by_path and fp32 in by_path:
            speedup = by_path["bfloat16"]["nanovllm_tok_s"] / by_path[fp32]["nanovllm_tok_s"]
            print(f"nano-vllm bfloat16 / {fp32} throughput: {speedup:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
                       "threads": torch.get_num_threads(), "machine": info, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
