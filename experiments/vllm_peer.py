"""The vLLM side of ``experiments/bench_vs_vllm.py``; runs in vLLM's own virtualenv (never nano-vllm's).

    VLLM_PYTHON experiments/vllm_peer.py JOB.json  -> prints one line: RESULT_PREFIX + JSON

JOB: {"model": dense HF model dir, "dtype": "bfloat16"|"float32", "prompts": [[token ids]...],
"max_tokens": int, "max_model_len": int, "batch1": bool (default true)}. It times the same thing as bench_vs_hf.py does for nano-vllm and
transformers: all prompts in one ``generate`` call (greedy, EOS ignored), then batch-1 decode latency as
(time for max_tokens - time for 1 token) / (max_tokens - 1) on the first prompt. Only the standard library and
vLLM are imported here.
"""

from __future__ import annotations

import json
import sys
import time

# vLLM writes to stdout too (also at exit); the result is the line with this prefix.
RESULT_PREFIX = "nano-vllm-bench-result: "


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    # On CPU, gpu_memory_utilization is the share of RAM vLLM reserves (KV cache included); 0.92 by default,
    # more than a machine running anything else has free. A few GiB hold this benchmark's cache many times over.
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
              trust_remote_code=False, gpu_memory_utilization=job.get("memory_fraction", 0.3))
    load_s = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]

    def generate(batch, n):
        params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
        begin = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - begin, [list(o.outputs[0].token_ids) for o in outputs]

    generate(prompts, job["max_tokens"])  # warm-up on the whole workload, untimed, as the other two engines get
    elapsed, tokens = generate(prompts, job["max_tokens"])
    batch1_ms = None
    if job.get("batch1", True):
        generate(prompts[:1], 2)
        short = min(generate(prompts[:1], 1)[0] for _ in range(2))
        full = generate(prompts[:1], job["max_tokens"])[0]
        batch1_ms = (full - short) / (job["max_tokens"] - 1) * 1e3
    print(RESULT_PREFIX + json.dumps({
        "vllm_tok_s": len(prompts) * job["max_tokens"] / elapsed,
        "vllm_batch1_ms_per_token": batch1_ms,
        "vllm_load_s": load_s, "vllm_outputs": tokens,
    }))


if __name__ == "__main__":
    main()
