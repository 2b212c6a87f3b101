"""GPU throughput on upstream nano-vllm's benchmark shape, side by side with transformers on the same GPU.

Workload (upstream nano-vllm's bench.py): 256 sequences of random token ids, input and output lengths each
uniform in 100..1024, EOS ignored so every sequence produces exactly its output length. Both engines decode
greedily (upstream samples at temperature 0.6; the work is the same). nano-vllm runs attention=flashinfer with
CUDA-graph decode; transformers runs ``generate`` on left-padded batches of ``--hf-batch`` sequences, each
batch up to its longest output, and is credited only with the tokens the workload asked for.

    python experiments/bench_gpu.py [--model PATH ...] [--dtype bfloat16] [--num-seqs 256] [--json FILE]

Prints one markdown table row per (model, engine) after a header; experiments/gpu_check.sh wraps it into the
summary block for docs/gpu.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

import torch
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams, machine


def make_workload(num_seqs: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Upstream's shape: prompt and output lengths uniform in 100..1024, token ids uniform below 10000."""
    rng = random.Random(seed)
    high = min(10_000, vocab) - 1
    prompts = [[rng.randint(0, high) for _ in range(rng.randint(100, 1024))] for _ in range(num_seqs)]
    output_lens = [rng.randint(100, 1024) for _ in range(num_seqs)]
    return prompts, output_lens


def bench_nanovllm(model: str | None, dtype: str, prompts, output_lens, args) -> tuple[LLM, float]:
    llm = LLM(model=model, device="cuda", dtype=dtype, attention="flashinfer", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=2048,
              kv_cache_fraction=args.kv_cache_fraction, enforce_eager=args.enforce_eager)
    llm.generate([prompts[0][:16], prompts[1][:32]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    if produced != sum(output_lens):
        raise RuntimeError(f"nano-vllm produced {produced} tokens, the workload asked for {sum(output_lens)}")
    return llm, elapsed


def bench_transformers(model_dir, dtype: str, prompts, output_lens, batch: int, pad_id: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to("cuda").eval()
    elapsed = 0.0
    for start in range(0, len(prompts), batch):
        chunk, lens = prompts[start:start + batch], output_lens[start:start + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=False, pad_token_id=pad_id)
        torch.cuda.synchronize()
        elapsed += time.perf_counter() - t0
    del model
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", default=None,
                        help="HF directory or .gguf (repeatable); default: the default model")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--kv-cache-fraction", type=float, default=0.5)
    parser.add_argument("--enforce-eager", action="store_true", help="nano-vllm without CUDA graphs")
    parser.add_argument("--hf-batch", type=int, default=64, help="transformers sequences per generate call")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()

    host = machine.describe(torch.get_num_threads())  # the host CPU: the GPU is named in each model's row
    print(machine.header(info=host), flush=True)
    print("| model | engine | output tokens | seconds | output tok/s | vs transformers |")
    print("|---|---|---|---|---|---|")
    results = []
    for model in args.model or [None]:
        prompts, output_lens = _workload(model, args)
        llm, ours_s = bench_nanovllm(model, args.dtype, prompts, output_lens, args)
        engine = llm.engine
        name, model_dir = engine.model_dir.name, engine.model_dir
        pad_id = engine.hf_config.eos_token_id if engine.hf_config.eos_token_id is not None else 0
        pad_id = pad_id[0] if isinstance(pad_id, list) else pad_id
        del llm, engine
        gc.collect()
        torch.cuda.empty_cache()
        total = sum(output_lens)
        hf_s = None if args.skip_transformers else bench_transformers(model_dir, args.dtype, prompts, output_lens,
                                                                         args.hf_batch, pad_id)
        ratio = f"{hf_s / ours_s:.2f}x" if hf_s else "n/a"
        graphs = "eager" if args.enforce_eager else "CUDA graphs"
        print(f"| {name} | nano-vllm (flashinfer, {args.dtype}, {graphs}) | {total} | {ours_s:.1f} | "
              f"{total / ours_s:.0f} | {ratio} |")
        if hf_s:
            print(f"| {name} | transformers generate (batches of {args.hf_batch}) | {total} | {hf_s:.1f} | "
                  f"{total / hf_s:.0f} | 1.00x |")
        results.append({"model": name, "dtype": args.dtype, "num_seqs": args.num_seqs, "output_tokens": total,
                        "nanovllm_s": ours_s, "transformers_s": hf_s, "enforce_eager": args.enforce_eager})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": host, "results": results}, f, indent=2)


def _workload(model: str | None, args) -> tuple[list[list[int]], list[int]]:
    from transformers import AutoConfig

    from nanovllm.models.loader import resolve_model

    vocab = AutoConfig.from_pretrained(resolve_model(model)).vocab_size
    return make_workload(args.num_seqs, vocab, args.seed)


if __name__ == "__main__":
    main()
