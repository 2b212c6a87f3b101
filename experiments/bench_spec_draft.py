"""Speculative decoding with model proposers against no speculation, side by side in one process: batch 1,
greedy, on the chat prompts (``nanovllm/data/chat_prompts.json``, chat-templated). Configurations: none,
``draft`` (the default model's own 4-bit GGUF drafting for its float path) and ``layer_skip`` (the target's
first layers). Each round runs every configuration once per prompt in turn, so each timing has the others'
beside it in the same spell of the (shared) machine:

    python experiments/bench_spec_draft.py [--dtype float32] [--k 3] [--prompts 4] [--rounds 3] [--max-tokens 64]
        [--layers N]

Prints per configuration the output tokens per second over all prompts of a round (min / median / max over
rounds), the median's ratio to no speculation, the acceptance rate and tokens per decode step; and checks the
outputs identical to no speculation (greedy: they must be).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from nanovllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--prompts", type=int, default=4, help="chat prompts used (the first N)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=None, help="layer_skip's num_layers (default: half)")
    parser.add_argument("--methods", default="draft,layer_skip", help="proposers timed beside no speculation")
    args = parser.parse_args()
    options = dict(dtype=args.dtype, num_kv_blocks=256, max_model_len=2048)
    configs = {
        "none": None,
        "draft": dict(method="draft", num_speculative_tokens=args.k),
        "layer_skip": dict(method="layer_skip", num_speculative_tokens=args.k, num_layers=args.layers),
    }
    chosen = ["none", *(m for m in args.methods.split(",") if m)]
    unknown = [m for m in chosen if m not in configs]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {[m for m in configs if m != 'none']}")
    configs = {name: configs[name] for name in chosen}
    llms = {name: LLM(**options, speculative=spec) for name, spec in configs.items()}
    data = json.loads((Path(__file__).resolve().parents[1] / "nanovllm/data/chat_prompts.json").read_text())
    prompts = [llms["none"].apply_chat_template(item["messages"]) for item in data[:args.prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in llms.values():   # one untimed pass each: first-call costs out of the way
        llm.generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)
    speed: dict[str, list[float]] = {name: [] for name in llms}
    outputs: dict[str, list] = {}
    steps: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            tokens, seconds, decode_steps, outs = 0, 0.0, 0, []
            for prompt in prompts:
                start = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)[0]
                seconds += time.perf_counter() - start
                tokens += len(out.token_ids)
                decode_steps += sum(1 for s in llm.last_steps if s["num_decode_seqs"])
                outs.append(out)
            speed[name].append(tokens / seconds)
            outputs[name], steps[name] = outs, decode_steps
    print(f"dtype={args.dtype}, batch 1, greedy, K={args.k}, {len(prompts)} chat prompts x {args.max_tokens} tokens, "
          f"{args.rounds} rounds")
    print(f"{'config':11} {'tok/s min':>9} {'median':>7} {'max':>7} {'x none':>7} {'accept':>7} {'tok/step':>8} identical")
    base = statistics.median(speed["none"])
    for name in llms:
        outs = outputs[name]
        drafted = sum(o.metrics.spec_decode_num_draft_tokens for o in outs)
        accepted = sum(o.metrics.spec_decode_num_accepted_tokens for o in outs)
        rate = f"{accepted / drafted:7.2f}" if drafted else f"{'':7}"
        # Decode steps only: the first token of each request comes from its prefill.
        per_step = sum(len(o.token_ids) - 1 for o in outs) / max(1, steps[name])
        same = all(o.token_ids == b.token_ids for o, b in zip(outs, outputs["none"]))
        s = speed[name]
        print(f"{name:11} {min(s):9.1f} {statistics.median(s):7.1f} {max(s):7.1f} {statistics.median(s) / base:7.2f} "
              f"{rate} {per_step:8.2f} {same}")


if __name__ == "__main__":
    main()
