"""Anonymous memory taken by torch's cache of brgemm micro-kernels as the bf16/float32 linear meets every row
count from 1 to 256, for SmolLM2-135M's two inner sizes (576 and 1536), in one thread:

    OMP_NUM_THREADS=1 python experiments/brgemm_kernel_cache.py [bfloat16|float32]

torch compiles one micro-kernel per distinct call shape and keeps it for the life of the thread, so what a
server holds depends on how many row counts the linear passes to it (docs/faults.md, "A server for days").
Prints ``RssAnon`` before and after each of three sweeps: the first sweep compiles, the later ones must not grow.
"""

from __future__ import annotations

import os
import sys

import torch

from nanovllm import kernels


def anonymous_mib() -> float:
    for line in open(f"/proc/{os.getpid()}/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
    compiled = kernels.load()
    if dtype == torch.bfloat16 and not compiled.brgemm_bf16_available():
        raise SystemExit("bfloat16 brgemm needs AMX or AVX-512 BF16, which this CPU lacks: run it with float32")
    weights = {k: torch.randn(576, k).to(dtype) for k in (576, 1536)}
    packed = {k: compiled.pack_brgemm_weight(w) for k, w in weights.items()}
    for k in packed:   # the first call sets up what every later call shares
        compiled.brgemm_linear(torch.randn(1, k).to(dtype), packed[k], None, 576)
    print(f"{dtype}: RssAnon before {anonymous_mib():.1f} MiB", flush=True)
    for sweep in range(3):
        for rows in range(1, 257):
            for k in packed:
                compiled.brgemm_linear(torch.randn(rows, k).to(dtype), packed[k], None, 576)
        print(f"after sweep {sweep + 1} over rows 1-256: {anonymous_mib():.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
