"""Does torch.compile pay on top of the fast path? One decoder layer's MLP block (post-attention residual add,
RMSNorm, gate/up, SiLU-and-mul, down, residual add) of the default model, three ways, at several row counts:

- ``eager reference``: the model's reference modules, eager (transformers' arithmetic);
- ``inductor``: the same reference modules under ``torch.compile`` (Inductor, ``freezing`` on so weights are
  constant-folded and prepacked as Inductor does for CPU inference; one compile per row count, as CUDA-graph
  capture buckets batch sizes), compile time reported;
- ``fast path``: what the engine runs by default (fused, oneDNN-prepacked weights, the C++ add+RMSNorm and
  SiLU-and-mul kernels, the bf16 GEMV at 1-2 rows).

    python experiments/bench_compile.py [--dtype bfloat16] [--rows 1,16,64,256] [--threads 1]

Prints ms per call and the ratios. The attention and the rest of the step are not compiled here: the paged
attention kernel, the sampler and the cache writes are C++ calls that Inductor would treat as graph breaks.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from nanovllm import LLM, machine


def timed_ms(fn, repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def mlp_block(layer):
    """The post-attention half of a decoder layer: (x, attention output) -> next x."""
    def block(x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = x + attn_out
        return x + layer.mlp(layer.post_attention_layernorm(x))
    return block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine.header(torch.get_num_threads()), flush=True)
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    dtype = getattr(torch, args.dtype)
    reference = LLM(dtype=args.dtype, fuse_projections=False, num_kv_blocks=16).engine.runner.model.layers[0]
    fast = LLM(dtype=args.dtype, fuse_projections=True, num_kv_blocks=16).engine.runner.model.layers[0]
    eager = mlp_block(copy.deepcopy(reference))
    fast_block = mlp_block(fast)
    print(f"{args.dtype}, {torch.get_num_threads()} threads, one decoder layer's MLP block (SmolLM2-135M)")
    print("| rows | eager reference ms | inductor ms | compile s | fast path ms | inductor / eager | "
          "fast path / inductor |")
    print("|---|---|---|---|---|---|---|")
    for rows in [int(r) for r in args.rows.split(",") if r]:
        x = torch.randn(rows, reference.mlp.down_proj.out_features).to(dtype)
        attn_out = torch.randn_like(x)
        torch._dynamo.reset()
        compiled = torch.compile(mlp_block(copy.deepcopy(reference)), dynamic=False)
        with torch.inference_mode():
            start = time.perf_counter()
            compiled(x, attn_out)
            compile_s = time.perf_counter() - start
            eager_ms = timed_ms(lambda: eager(x, attn_out))
            inductor_ms = timed_ms(lambda: compiled(x, attn_out))
            fast_ms = timed_ms(lambda: fast_block(x.clone(), attn_out))
        print(f"| {rows} | {eager_ms:.3f} | {inductor_ms:.3f} | {compile_s:.1f} | {fast_ms:.3f} | "
              f"{eager_ms / inductor_ms:.2f}x faster | {inductor_ms / fast_ms:.2f}x faster |")


if __name__ == "__main__":
    main()
