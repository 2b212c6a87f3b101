"""Speculative decoding with the ``ngram`` proposer against no speculation, side by side in one process: batch 1,
greedy, on prompts whose output copies from the prompt (a list to repeat, code to copy) and one that does not.
Each round runs every configuration once per prompt in turn, so every timing of one has a timing of the other
beside it in the same spell of the (shared) machine:

    python experiments/bench_spec_ngram.py [--dtype float32] [--fuse-projections] [--k 2,3,4] [--rounds 3]
                                           [--max-tokens 128]

``--dtype float32`` runs the exact reference path (transformers' separate projections, torch's own matmul);
``--dtype bfloat16``, or float32 with ``--fuse-projections``, the fast path the engine serves with (fused,
prepacked weights, ``nanovllm.models.fast_path``). Prints, per prompt and K, the output tokens per second of
each (median over rounds), their ratio, the acceptance rate (accepted / proposed tokens), the mean tokens per
step and what a step costs against a step without speculation (tokens per step / ratio: verifying K+1 tokens
in one forward pass is not free); and whether the outputs are identical (on the reference path they must be;
a fast path is held to the close standard, and its matmuls may round a K+1-row step differently from a
one-row step).
"""

from __future__ import annotations

import argparse
import statistics
import time

from nanovllm import LLM, SamplingParams

LIST = "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango, nectarine, orange"
CODE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\n"
        "def div(a, b):\n    return a / b\n")
PROMPTS = {
    "repeat-list": f"Repeat this list exactly, three times: {LIST}. Again: {LIST}. Again:",
    "copy-code": "Copy the following code exactly.\n\n" + CODE + "\nCopy:\n\ndef add",
    "free-text": "Once upon a time, in a small village at the edge of a great forest, there lived",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--fuse-projections", action="store_true", help="float32 on the fast path (fused, prepacked)")
    parser.add_argument("--k", default="2,3,4", help="num_speculative_tokens values, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    options = dict(dtype=args.dtype, num_kv_blocks=256, max_model_len=1024,
                   fuse_projections=True if args.fuse_projections else None)
    llms = {0: LLM(**options)} | {k: LLM(**options, speculative=dict(method="ngram", num_speculative_tokens=k))
                                   for k in ks}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    speed: dict[tuple[str, int], list[float]] = {}
    outputs: dict[tuple[str, int], list] = {}
    for llm in llms.values():   # one untimed pass each: first-call costs out of the way
        llm.generate(list(PROMPTS.values())[:1], SamplingParams(max_tokens=8), use_tqdm=False)
    for _ in range(args.rounds):
        for name, prompt in PROMPTS.items():
            for k, llm in llms.items():
                start = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)[0]
                speed.setdefault((name, k), []).append(len(out.token_ids) / (time.perf_counter() - start))
                outputs[(name, k)] = [out, len(llm.last_steps)]
    path = "fast path" if llms[0].engine.config.fast_path else "reference path"
    print(f"dtype={args.dtype} ({path}), batch 1, greedy, {args.max_tokens} tokens, median of {args.rounds} rounds")
    print(f"{'prompt':12} {'K':>2} {'tok/s':>7} {'x base':>7} {'accept':>7} {'tok/step':>8} {'step x':>6} identical")
    for name in PROMPTS:
        base = statistics.median(speed[(name, 0)])
        for k in llms:
            out, steps = outputs[(name, k)]
            m = out.metrics
            rate = m.spec_decode_num_accepted_tokens / m.spec_decode_num_draft_tokens if m.spec_decode_num_draft_tokens \
                else float("nan")
            same = out.token_ids == outputs[(name, 0)][0].token_ids
            tps = statistics.median(speed[(name, k)])
            per_step = len(out.token_ids) / steps
            print(f"{name:12} {k:>2} {tps:7.1f} {tps / base:7.2f} {rate:7.2f} {per_step:8.2f} "
                  f"{per_step / (tps / base):6.2f} {same}")


if __name__ == "__main__":
    main()
