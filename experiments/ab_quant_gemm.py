"""Two versions of the quantized kernels' source side by side in one process: the int8 linears of one step of the
default model, each version in turn, round after round, so that every round of A has a round of B beside it.

On a shared machine the speed of a whole process can move between spells by more than a kernel change does (the
AVX-512 BF16 EPYC of docs/quantization.md: int8 runs in two clusters of speed, an OpenMP fork/join costing more in
one than in the other). Timing version A in one process and version B in the next compares the spells as much
as the kernels; pairing the rounds in one process does not. Each version is compiled from its file (with this
build's flags, in its own operator namespace) and runs ``quantize_rows`` and ``x16_gemm`` (the VNNI int8
kernel, ``i8x16_linear``'s) directly, without torch's dispatcher:

    git show HEAD~1:nanovllm/csrc/quant_gemm.cpp > /tmp/before.cpp
    python experiments/ab_quant_gemm.py /tmp/before.cpp nanovllm/csrc/quant_gemm.cpp --rows 32,1600 [--rounds 6]

Per round it prints each version's ms per step (the decoder layers' 120 linears and the LM head, at ``--rows``
rows) for the activation quantizer and the GEMM, and their ratio (A / B: above 1, B is faster). Needs a CPU
with AVX-512 VNNI (the avx512_bf16 kernel build).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_linears import step_shapes  # noqa: E402

from nanovllm import kernels, machine  # noqa: E402
from nanovllm.models.quantized import pack_i8x16  # noqa: E402

# Appended to each version's source: the two phases of an int8 linear, timed in C++ (the best of `reps` passes
# over `codes`, one weight set after another, as a step streams its layers' weights).
TIMER = r"""
#include <torch/extension.h>
#include <chrono>
std::vector<double> ab_phases(at::Tensor x, std::vector<at::Tensor> codes, at::Tensor scales, int64_t n,
                              int64_t reps) {
  const auto now = [] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  };
  const int64_t rows = x.size(0), k = x.size(1), nb = k / QK;
  auto y = at::empty({rows, n}, x.options());
  double best_quantize = 1e30, best_gemm = 1e30;
  for (int64_t r = 0; r < reps; ++r) {
    const double t0 = now();
    QuantizedRows xq;
    for (size_t i = 0; i < codes.size(); ++i) xq = quantize_activations(x, true);
    const double t1 = now();
    for (const auto& c : codes) {
      const I8x16Weights w{c.data_ptr<uint8_t>(), scales.data_ptr<float>(), nb};
      x16_gemm(rows, k, n, w, static_cast<const c10::BFloat16*>(nullptr), y.data_ptr<c10::BFloat16>(),
               xq.codes.data_ptr<int8_t>(), xq.scales.data_ptr<float>(), xq.sums.data_ptr<float>(),
               xq.code_sums_ptr());
    }
    const double t2 = now();
    best_quantize = std::min(best_quantize, (t1 - t0) / codes.size());
    best_gemm = std::min(best_gemm, (t2 - t1) / codes.size());
  }
  return {best_quantize, best_gemm};
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("ab_phases", &ab_phases); }
"""


def build(source: Path, index: int, build_dir: Path):
    """One version: its source with TIMER appended, compiled with the avx512_bf16 build's flags."""
    from torch.utils import cpp_extension

    wrapper = build_dir / f"ab_version_{index}.cpp"
    wrapper.write_text(f'#include "{source.resolve()}"\n{TIMER}')
    flags = kernels.CFLAGS + kernels.ISA_CFLAGS["avx512_bf16"] + [f"-DNANOVLLM_OPS=nanovllm_ab_{index}",
                                                                   f"-I{kernels.CSRC}"]
    return cpp_extension.load(name=f"nanovllm_ab_{index}", sources=[str(wrapper)], extra_cflags=flags,
                              extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="version A of nanovllm/csrc/quant_gemm.cpp")
    parser.add_argument("after", type=Path, help="version B")
    parser.add_argument("--rows", default="32,1600", help="comma-separated row counts (a decode step's, a prefill's)")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if "avx512_bf16" not in machine.supported_isas():
        sys.exit("ab_quant_gemm.py times the VNNI int8 kernel: this CPU has no AVX-512 BF16/VNNI build")
    with tempfile.TemporaryDirectory() as build_dir:
        versions = [build(path, i, Path(build_dir)) for i, path in enumerate((args.before, args.after))]
        layers = collections.Counter(step_shapes())  # (n, k) -> linears of that shape in a step
        generator = torch.Generator().manual_seed(0)
        for rows in (int(r) for r in args.rows.split(",")):
            # Distinct weight sets per shape (up to 30, 2 for the LM head), so that weights stream as in a step.
            cases = []
            for (n, k), count in layers.items():
                sets = max(2, min(count, 30 if rows <= 64 else 3))
                packed = [pack_i8x16(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator),
                                     torch.rand(n, generator=generator)) for _ in range(sets)]
                x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
                cases.append((n, count, [codes for codes, _ in packed], packed[0][1], x))
            ratios = {"quantize": [], "gemm": []}
            for round_ in range(args.rounds):
                per_version = []
                for version in versions:
                    quantize = gemm = 0.0
                    for n, count, codes, scales, x in cases:
                        q, g = version.ab_phases(x, codes, scales, n, 3 if rows <= 64 else 1)
                        quantize += count * q
                        gemm += count * g
                    per_version.append((quantize * 1e3, gemm * 1e3))
                (qa, ga), (qb, gb) = per_version
                ratios["quantize"].append(qa / qb)
                ratios["gemm"].append(ga / gb)
                print(f"rows {rows} round {round_}: quantize A {qa:.2f} ms, B {qb:.2f} ms ({qa / qb:.3f}); "
                      f"GEMM A {ga:.2f} ms, B {gb:.2f} ms ({ga / gb:.3f})", flush=True)
            print(f"rows {rows}: median A / B: quantize {statistics.median(ratios['quantize']):.3f}, "
                  f"GEMM {statistics.median(ratios['gemm']):.3f} ({args.rounds} paired rounds)", flush=True)


if __name__ == "__main__":
    main()
