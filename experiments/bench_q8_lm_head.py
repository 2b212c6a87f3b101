"""The gguf model's Q8_0 LM head on its two kernels, side by side in one process: ``q8x16_linear`` (Q8_0
interleaved by 16 features, the avx2 and avx512 builds) against the row kernel (``quant_linear``) on the same
blocks. First the layer alone at 1, 2 and 32 rows; then whole runs of the default GGUF model (32 chat prompts x 64
tokens, and batch 1) with the LM head switched between the two kernels in turn, so both see the same machine.

    python experiments/bench_q8_lm_head.py [--pairs 6] [--threads 2]

Needs a build with q8x16_linear (an AVX2 CPU without AVX-512 BF16); says so and stops elsewhere.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_hf import batch1_decode_ms, chat_prompts, run_nanovllm  # noqa: E402

from nanovllm import LLM  # noqa: E402
from nanovllm.models.quantized import QuantLinear  # noqa: E402


def on_rows(layer: QuantLinear) -> QuantLinear:
    """The same Q8_0 blocks, stored plainly, so ``layer``'s kernel build runs them on its row kernel."""
    codes, scales, _ = layer.canonical()
    plain = QuantLinear("q8_0", codes, scales, None, layer.bias, layer.in_features, None)
    plain.kernels = layer.kernels
    return plain


def median_ms(run, x: torch.Tensor, repeats: int = 15) -> float:
    run(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(x)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=6, help="whole runs per kernel, alternating")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(quantization="gguf")
    model = llm.engine.runner.model
    interleaved = model.lm_head_chunks
    if any(chunk.kernel != "q8x16" for chunk in interleaved):
        raise SystemExit(f"this kernel build runs the Q8_0 LM head on '{interleaved[0].kernel}', not q8x16")
    rows_kernel = torch.nn.ModuleList(on_rows(chunk) for chunk in interleaved)

    print(f"LM head {interleaved[0].out_features} x {interleaved[0].in_features} Q8_0, {args.threads} threads")
    print("| rows | q8x16 ms | row kernel ms | q8x16 vs row kernel |\n|---|---|---|---|")
    for rows in (1, 2, 32):
        x = torch.randn(rows, interleaved[0].in_features)
        fast, slow = median_ms(interleaved[0], x), median_ms(rows_kernel[0], x)
        print(f"| {rows} | {fast:.2f} | {slow:.2f} | {slow / fast:.2f}x |")

    prompts = chat_prompts(llm, 32)
    run_nanovllm(llm, prompts[:4], 8)  # warm-up
    print("\n| pair | q8x16 tok/s | row kernel tok/s | q8x16 batch-1 ms | row kernel batch-1 ms |\n|---|---|---|---|---|")
    for pair in range(args.pairs):
        figures = []
        for head in (interleaved, rows_kernel):
            model.lm_head_chunks = head
            seconds, _ = run_nanovllm(llm, prompts, 64)
            batch1 = batch1_decode_ms(lambda p, n: run_nanovllm(llm, [p], n), prompts[0], 32, 2)
            figures.append((len(prompts) * 64 / seconds, batch1))
        print(f"| {pair + 1} | {figures[0][0]:.1f} | {figures[1][0]:.1f} | {figures[0][1]:.2f} | {figures[1][1]:.2f} |",
              flush=True)
    model.lm_head_chunks = interleaved


if __name__ == "__main__":
    main()
