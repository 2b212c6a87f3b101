"""What each int8 activation scheme costs in perplexity, emulated in torch over the same int8 weights.

Every int8 linear of ``LLM(quantization="int8")`` gets a float emulation as its forward: the activations
quantized by the scheme, times the layer's dequantized int8 weight. The perplexity is then taken on
``nanovllm/data/held_out.txt`` (``nanovllm.validate.sequence_perplexity``) and compared with the dense path's in
the same dtype. Schemes: float activations (the int8 weights' own cost), one scale per token in two int8 digits
(the AMX kernel, ``nanovllm/csrc/int8_amx.cpp``), one scale per token in one digit (vLLM's dynamic per-token).

    python experiments/int8_activation_schemes.py      # ~3 min on 1 thread; docs/quantization.md has the table
"""

from __future__ import annotations

from pathlib import Path

import torch

from nanovllm import LLM
from nanovllm.models.quantized import QuantLinear
from nanovllm.validate import HELD_OUT_TEXT, sequence_perplexity


def quantized_activations(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """x [rows, K] as the scheme rounds it (float32)."""
    if scheme == "float":
        return x
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    p1 = torch.round(x * inv)
    if scheme == "one digit per token":
        return p1 * (amax / 127)
    p2 = (torch.round(x * (inv * 256)) - 256 * p1).clamp(max=127)
    return (p1 + p2 / 256) * (amax / 127)


SCHEMES = ("float", "two digits per token", "one digit per token")


def main() -> None:
    torch.set_num_threads(1)
    scheme = {"name": "float"}
    original_forward = QuantLinear.forward

    def emulated(self: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        if not hasattr(self, "_dequantized"):
            self._dequantized = self.dequantize()
        y = quantized_activations(flat, scheme["name"]) @ self._dequantized.T
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    print("| activations | dtype | perplexity | dense | cost |\n|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        dense = LLM(dtype=dtype)
        ids = dense.tokenizer.encode(Path(HELD_OUT_TEXT).read_text())
        base = sequence_perplexity(dense, ids)
        del dense
        llm = LLM(dtype=dtype, quantization="int8")
        QuantLinear.forward = emulated
        try:
            for name in SCHEMES:
                scheme["name"] = name
                ppl = sequence_perplexity(llm, ids)
                print(f"| {name} | {dtype} | {ppl:.3f} | {base:.3f} | {100 * (ppl / base - 1):+.2f}% |", flush=True)
        finally:
            QuantLinear.forward = original_forward
        del llm


if __name__ == "__main__":
    main()
