"""The dense linear kernels side by side: one decode/prefill step's matmuls of the default model, per row count.

Each row count M runs every linear of SmolLM2-135M's fast path once (fused q/k/v, o, fused gate/up and down per
layer, then the LM head), each with its own weight, so the weights stream from memory as in a real step rather
than staying in cache. Kernels (those this machine runs for the dtype):

- ``onednn``: oneDNN's prepacked linear (``torch.ops.mkldnn._linear_pointwise`` on a weight reordered once),
  the kernel nano-vllm's fast path used before ``brgemm`` and the one vLLM's CPU build uses for these shapes.
- ``brgemm``: nano-vllm's ``brgemm_linear`` (``nanovllm/csrc/brgemm_linear.cpp``): oneDNN's brgemm micro-kernel
  over 32-feature weight blocks packed once (AMX tiles for bfloat16 on AMX).
- ``gemv``: nano-vllm's bf16 GEMV (``nanovllm/csrc/gemv.cpp``), bfloat16 only, at 1 and 2 rows.
- ``bf16-fma``: nano-vllm's ``bf16_fma_linear`` (``nanovllm/csrc/bf16_fma_linear.cpp``), bfloat16 only, wherever
  the build has AVX2: bf16 weights widened to float32 in registers, float32 FMAs (the fast path's bf16 kernel on
  AVX2, where the base is ``aten``).
- ``int8``: ``quantization="int8"``'s linear on the same weights made int8 (bfloat16 activations): the AMX-INT8
  kernel (``nanovllm/csrc/int8_amx.cpp``) where the CPU runs it, the vector kernel (``quant_gemm.cpp``)
  elsewhere; its activation quantization included. ``--int8-vector`` adds the vector (row) kernel where int8 runs another (AMX tiles, i8x16).
- ``q4``: ``quantization="gguf"``'s Q4_1 layers on random blocks of the same shapes: the kernel a gguf model
  runs here (Q4 interleaved by 16 features wherever the build has AVX2, else the row kernel), and ``q4-rows``, the
  row-by-row kernel, where the two differ.

    python experiments/bench_linears.py [--dtypes bfloat16,float32] [--rows 1,2,8,32,128,512] [--threads 1,2]

Prints ms per step and each kernel's speed relative to ``onednn`` (above 1: faster; ``aten``, torch's own
linear, where oneDNN has no kernel for the dtype: bfloat16 on AVX2), in one process, one
kernel after the other at each row count. ``NANOVLLM_CPU_ISA`` / ``ONEDNN_MAX_CPU_ISA`` cap the levels as for
the engine.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from nanovllm import kernels as compiled_kernels
from nanovllm import machine
from nanovllm.models.loader import resolve_model


def step_shapes() -> list[tuple[int, int]]:
    """(out_features, in_features) of every linear one step of the default model runs, in order."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model(weights=False))
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    layer = [(qkv, hidden), (hidden, config.num_attention_heads * head_dim),
             (2 * config.intermediate_size, hidden), (hidden, config.intermediate_size)]
    return layer * config.num_hidden_layers + [(config.vocab_size, hidden)]


def kernels_for(dtype: torch.dtype, weights: list[torch.Tensor], ops,
                int8_vector: bool = False) -> dict[str, Callable[[int, torch.Tensor], object]]:
    """Each kernel as ``run(i, x)``: linear ``i`` of the step on input ``x``, weights prepared once here."""
    from nanovllm.models.quantized import QuantLinear, int8_kernel

    runs: dict[str, Callable[[int, torch.Tensor], object]] = {}
    try:
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
        runs["onednn"] = lambda i, x: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], "")
    except RuntimeError:  # bf16 on AVX2: oneDNN has no bf16 linear here, and the fast path runs ATen's
        runs["aten"] = lambda i, x: torch.nn.functional.linear(x, weights[i])
    if machine.selected_isa() != "scalar" and (dtype == torch.float32 or ops.brgemm_bf16_available()):
        blocks = [ops.pack_brgemm_weight(w) for w in weights]
        runs["brgemm"] = lambda i, x: ops.brgemm_linear_op(x, blocks[i], None, weights[i].shape[0])
    if dtype == torch.bfloat16 and ops.gemv_available():
        runs["gemv"] = lambda i, x: ops.gemv_bf16_op(x, weights[i], None)
    if dtype == torch.bfloat16 and ops.bf16_fma_available():
        fma_blocks = [ops.pack_bf16_fma_weight(w) for w in weights]
        runs["bf16-fma"] = lambda i, x: ops.bf16_fma_linear_op(x, fma_blocks[i], None, weights[i].shape[0])
    if dtype == torch.bfloat16 and machine.selected_isa() != "scalar":
        int8 = [QuantLinear.from_dense_int8(w, None, ops) for w in weights]
        runs["int8"] = lambda i, x: int8[i](x)
        if int8_vector and int8_kernel(ops) != "vector":
            vector = [QuantLinear.from_dense_int8(w, None, None) for w in weights]
            for layer in vector:
                layer.kernels = ops
            runs["int8-vector"] = lambda i, x: vector[i](x)
        q4 = [random_q4(w.shape, ops) for w in weights]
        runs["q4"] = lambda i, x: q4[i](x)
        if q4[0].kernel != "vector":
            rows = [random_q4(w.shape, None) for w in weights]
            for layer in rows:
                layer.kernels = ops
            runs["q4-rows"] = lambda i, x: rows[i](x)
    return runs


def random_q4(shape: torch.Size, ops):
    """A Q4_1 layer of ``shape`` with random codes, scales and offsets (the kernel's speed does not depend on them)."""
    from nanovllm.models.quantized import QuantLinear

    n, k = shape
    generator = torch.Generator().manual_seed(n * 7 + k)
    codes = torch.randint(0, 256, (n, k // 2), generator=generator, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, generator=generator) * 1e-3).half()
    mins = (torch.randn(n, k // 32, generator=generator) * 1e-3).half()
    return QuantLinear("q4_1", codes, scales, mins, None, k, ops)


def time_step(run: Callable[[int, torch.Tensor], object], shapes: list[tuple[int, int]], rows: int,
              dtype: torch.dtype) -> float:
    """Seconds per step of ``run`` over ``shapes`` at ``rows`` rows (median of the timed repeats)."""
    inputs = {k: torch.randn(rows, k, dtype=dtype) for k in {k for _, k in shapes}}

    def step() -> None:
        for i, (_, k) in enumerate(shapes):
            run(i, inputs[k])

    for _ in range(2):
        step()
    times = []
    for _ in range(5 if rows > 64 else 10):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def check_agreement(runs: dict, weights: list[torch.Tensor], dtype: torch.dtype) -> None:
    """Every kernel computes the same linear (to the dtype's rounding) before any is timed."""
    x = torch.randn(5, weights[0].shape[1], dtype=dtype)
    dense = x.float() @ weights[0].float().T
    q4 = x.float() @ random_q4(weights[0].shape, None).dequantize().T  # the q4 kernels' own random weights
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for name, run in runs.items():
        reference = q4 if name.startswith("q4") else dense
        got = run(0, x).float()
        error = float((got - reference).abs().max() / reference.abs().max())
        if error > tolerance:
            raise SystemExit(f"error: kernel {name} disagrees with a float32 matmul (relative error {error:.2e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rows", default="1,2,8,32,128,512")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--int8-vector", action="store_true", help="also time the int8 vector (row) kernel where int8 runs another (AMX, i8x16)")
    args = parser.parse_args()
    machine.apply_isa_cap()
    ops = compiled_kernels.load()
    shapes = step_shapes()
    print(machine.header())
    results = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(0)
        weights = [torch.randn(n, k, dtype=dtype) * 0.02 for n, k in shapes]
        megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6  # dense weights
        runs = kernels_for(dtype, weights, ops, args.int8_vector)
        check_agreement(runs, weights, dtype)
        print(f"\n{dtype_name}: {len(shapes)} linears, {megabytes:.0f} MB of distinct weights per step")
        base = next(iter(runs))  # onednn, or ATen's linear where oneDNN has no kernel for the dtype
        print("| threads | rows | " + " | ".join(f"{name} ms" for name in runs) + " | " +
              " | ".join(f"{name} vs {base}" for name in runs if name != base) + " |")
        print("|---" * (2 + 2 * len(runs) - 1) + "|")
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for rows in (int(r) for r in args.rows.split(",")):
                times = {name: time_step(run, shapes, rows, dtype) for name, run in runs.items()
                         if name != "gemv" or rows <= 2}
                ratios = {name: times[base] / t for name, t in times.items() if name != base}
                cells = [f"{times[n] * 1e3:.2f}" if n in times else "-" for n in runs]
                cells += [f"{ratios[n]:.2f}x" if n in ratios else "-" for n in runs if n != base]
                print(f"| {threads} | {rows} | " + " | ".join(cells) + " |", flush=True)
                results.append(dict(dtype=dtype_name, threads=threads, rows=rows, ms={n: t * 1e3 for n, t in times.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine.describe(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
