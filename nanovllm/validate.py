"""``validate_output``: run nano-vllm and transformers on the same prompts (greedy, float32) and compare token
by token. The check a user runs before trusting any timing on a new model or a new plugin.

    python -m nanovllm.validate [--model PATH] [--prompts FILE] [--max-tokens N] [--scheduler NAME] ...

FILE holds one prompt per line (``.txt``) or a JSON list of strings or chat conversations (``.json``).
Exits non-zero when any prompt's tokens differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from nanovllm.chat_template import chat_token_ids

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def quicksort(items):",
    "Write a short poem about the sea.",
    "In a distant future, humanity has spread across the stars, and",
]


@dataclass
class PromptAgreement:
    prompt: str
    ours: list[int]
    reference: list[int]

    @property
    def matching_prefix(self) -> int:
        n = 0
        for a, b in zip(self.ours, self.reference):
            if a != b:
                break
            n += 1
        return n

    @property
    def identical(self) -> bool:
        return self.ours == self.reference


def load_prompts(path: str | Path | None, tokenizer) -> list[tuple[str, list[int]]]:
    """(label, token ids) per prompt from a .txt (one per line) or .json (strings or chat conversations)."""
    if path is None:
        items: list = DEFAULT_PROMPTS
    else:
        path = Path(path)
        text = path.read_text()
        items = json.loads(text) if path.suffix == ".json" else [line for line in text.splitlines() if line.strip()]
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append((item, tokenizer.encode(item)))
        else:
            messages = item["messages"] if isinstance(item, dict) else item
            prompts.append((messages[-1]["content"], chat_token_ids(tokenizer, messages)))
    return prompts


def reference_greedy(model, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False) -> list[list[int]]:
    """transformers ``generate``, greedy, one prompt at a time (no padding, so nothing perturbs its arithmetic):
    the reference every parity check compares against. Outputs end with EOS when generation stopped on it."""
    import torch

    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            generated = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens, min_new_tokens=max_tokens if ignore_eos else None, do_sample=False,
                pad_token_id=model.config.eos_token_id if model.config.eos_token_id is not None else 0,
            )
            outputs.append(generated[0, len(ids):].tolist())
    return outputs


def validate_output(
    model: str | None = None,
    prompts: str | Path | None = None,
    max_tokens: int = 32,
    **llm_options,
) -> list[PromptAgreement]:
    """Greedy float32 generation from nano-vllm (all prompts in one batch) and from transformers ``generate``
    (one prompt at a time, unpadded); returns the per-prompt comparison."""
    import torch
    from transformers import AutoModelForCausalLM

    from nanovllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", **llm_options)
    pairs = load_prompts(prompts, llm.tokenizer)
    outputs = llm.generate([ids for _, ids in pairs], SamplingParams(temperature=0, max_tokens=max_tokens),
                           use_tqdm=False)
    reference_model = AutoModelForCausalLM.from_pretrained(
        llm.engine.model_dir, dtype=torch.float32, trust_remote_code=False, use_safetensors=True).eval()
    references = reference_greedy(reference_model, [ids for _, ids in pairs], max_tokens)
    results = [PromptAgreement(label, output.token_ids, reference)
               for (label, _), output, reference in zip(pairs, outputs, references)]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.validate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--prompts", default=None, help=".txt (one per line) or .json file of prompts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--scheduler", default="fcfs")
    parser.add_argument("--allocator", default="paged")
    parser.add_argument("--attention", default="torch")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        results = validate_output(
            args.model, args.prompts, args.max_tokens, scheduler=args.scheduler, allocator=args.allocator,
            attention=args.attention, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        )
    except (ValueError, KeyError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for i, r in enumerate(results):
        status = "OK  " if r.identical else "DIFF"
        print(f"{status} prompt {i}: {r.matching_prefix}/{max(len(r.ours), len(r.reference))} tokens agree  "
              f"{r.prompt[:60]!r}")
    bad = sum(not r.identical for r in results)
    print(f"{len(results) - bad}/{len(results)} prompts token-identical to transformers")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
