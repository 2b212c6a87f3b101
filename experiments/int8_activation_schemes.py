"""What each int8 activation scheme costs in perplexity and greedy closeness, emulated in torch over the same
int8 weights.

Every int8 linear of ``LLM(quantization="int8")`` gets a float emulation as its forward (the decoder layers in
the Python loop, so the C++ stack does not bypass it): the activations quantized by the scheme, times the
layer's dequantized int8 weight. The perplexity is then taken on ``nanovllm/data/held_out.txt``
(``nanovllm.validate.sequence_perplexity``) and compared with the dense path's in the same dtype. Schemes: float
activations (the int8 weights' own cost), one scale per token in two int8 digits, in one digit (vLLM's dynamic
per-token), and per-projection plans of one and two digits on the AMX tiles, among them the one the model uses
(``INT8_ACTIVATION_DIGITS``). For each plan it also reports the greedy check of ``python -m nanovllm.validate``:
at each prompt's first divergence from the dense path, are both tokens in the other side's top-5?

    python experiments/int8_activation_schemes.py      # ~6 min on 2 threads; docs/quantization.md has the table
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.models.quantized import INT8_ACTIVATION_DIGITS, QuantLinear
from nanovllm.validate import HELD_OUT_TEXT, TOP_K, PromptAgreement, load_prompts, sequence_perplexity


def quantized_activations(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """x [rows, K] as the scheme (``float``, ``one digit``, ``two digits``) rounds it (float32)."""
    if scheme == "float":
        return x
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    p1 = torch.round(x * inv)
    if scheme == "one digit":
        return p1 * (amax / 127)
    p2 = (torch.round(x * (inv * 256)) - 256 * p1).clamp(max=127)
    return (p1 + p2 / 256) * (amax / 127)


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
# Plans: a scheme for every projection, or the projections that take one digit (the rest two).
PLANS: dict[str, dict[str, str]] = {
    "float activations": dict.fromkeys(PROJECTIONS, "float"),
    "two digits everywhere": dict.fromkeys(PROJECTIONS, "two digits"),
    "one digit everywhere (vLLM's)": dict.fromkeys(PROJECTIONS, "one digit"),
    **{f"one digit on {', '.join(ones)}": {p: "one digit" if p in ones else "two digits" for p in PROJECTIONS}
       for ones in [("qkv_proj",), ("o_proj",), ("gate_up_proj",), ("down_proj",), ("o_proj", "down_proj"),
                    ("o_proj", "gate_up_proj", "down_proj")]},
    "the model's (INT8_ACTIVATION_DIGITS)": {
        p: "one digit" if INT8_ACTIVATION_DIGITS.get(p, 2) == 1 else "two digits" for p in PROJECTIONS},
    "the model's, and one digit on lm_head": {
        p: "one digit" if INT8_ACTIVATION_DIGITS.get(p, 1 if p == "lm_head" else 2) == 1 else "two digits"
        for p in PROJECTIONS},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plans", default=None,
                        help=f"semicolon-separated plan names to run (default: all): {'; '.join(PLANS)}")
    args = parser.parse_args()
    chosen = list(PLANS) if args.plans is None else [p.strip() for p in args.plans.split(";")]
    unknown = [p for p in chosen if p not in PLANS]
    if unknown:
        parser.error(f"--plans: no plan named {unknown[0]!r}; the plans are: {'; '.join(PLANS)}")
    torch.set_num_threads(2)
    plan: dict[str, str] = {}
    original_forward = QuantLinear.forward

    def emulated(self: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        if not hasattr(self, "_dequantized"):
            self._dequantized = self.dequantize()
        y = quantized_activations(flat, plan[self._projection]) @ self._dequantized.T
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    params = SamplingParams(temperature=0, max_tokens=32, logprobs=TOP_K)

    def greedy(llm: LLM) -> list[tuple[list[int], list[set[int]]]]:
        """Each prompt's greedy tokens and, per position, its top-5 token ids (as validate_quantized takes them)."""
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.token_ids, [{t for t, lp in entry.items() if lp.rank <= TOP_K} for entry in o.logprobs])
                for o in outputs]

    print(f"| plan | dtype | perplexity | dense | cost | prompts close (top-{TOP_K}) |\n|---|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        dense = LLM(dtype=dtype)
        ids = dense.tokenizer.encode(Path(HELD_OUT_TEXT).read_text())
        prompts = [p for _, p in load_prompts(None, dense.tokenizer)]
        base = sequence_perplexity(dense, ids)
        reference = greedy(dense)
        del dense
        llm = LLM(dtype=dtype, quantization="int8")
        model = llm.engine.runner.model
        model.use_decoder_stack = False
        for layer in model.layers:
            for name in ("qkv_proj", "o_proj"):
                getattr(layer.self_attn, name)._projection = name
            for name in ("gate_up_proj", "down_proj"):
                getattr(layer.mlp, name)._projection = name
        for head in model.lm_head_layers():
            head._projection = "lm_head"
        QuantLinear.forward = emulated
        try:
            for name in chosen:
                plan.update(PLANS[name])
                ppl = sequence_perplexity(llm, ids)
                close = sum(PromptAgreement("", tokens, ref, top, ref_top).close
                            for (tokens, top), (ref, ref_top) in zip(greedy(llm), reference))
                print(f"| {name} | {dtype} | {ppl:.3f} | {base:.3f} | {100 * (ppl / base - 1):+.2f}% | "
                      f"{close}/{len(prompts)} |", flush=True)
        finally:
            QuantLinear.forward = original_forward
        del llm


if __name__ == "__main__":
    main()
