// y = x W^T (+ b) for a few rows of x in bfloat16: the linear layers of a small decode batch.
//
// With one to a few rows, a linear layer is a pass over its weight matrix and nothing else: the time is the
// bytes of W over the memory bandwidth. oneDNN's blocked GEMM, tuned for many rows, reads the weights there
// more slowly than a plain read of them does (experiments/bench_linears.py times both), so these rows take this
// path.
// Each work item is 16 output features: for every row of x, 16 running dot products over K with the
// AVX-512 BF16 dot-product instruction (pairs of bf16 products summed into float32 lanes), reduced together
// into 16 outputs, plus the bias, rounded once to bf16. The block's 16 weight rows stay in L1 between the
// rows of x, so W is read from memory once whatever the number of rows.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__)
namespace {

inline __m512bh load32_bf16(const c10::BFloat16* p, int64_t remaining) {
  const __mmask32 m = remaining >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << remaining) - 1);
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, p));
}

void gemv_rows(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y,
               int64_t rows, int64_t n, int64_t k) {
  const int64_t blocks = (n + 15) / 16;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * 16, count = std::min<int64_t>(16, n - first);
    for (int64_t r = 0; r < rows; ++r) {
      const c10::BFloat16* xr = x + r * k;
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      // Row by row, each weight row read front to back (one memory stream at a time is what the hardware
      // prefetcher follows best), with two accumulators to hide the dot product's latency.
      for (int j = 0; j < count; ++j) {
        const c10::BFloat16* wr = w + (first + j) * k;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        int64_t kk = 0;
        for (; kk + 64 <= k; kk += 64) {
          a0 = _mm512_dpbf16_ps(a0, load32_bf16(xr + kk, 32), load32_bf16(wr + kk, 32));
          a1 = _mm512_dpbf16_ps(a1, load32_bf16(xr + kk + 32, 32), load32_bf16(wr + kk + 32, 32));
        }
        for (; kk < k; kk += 32) a0 = _mm512_dpbf16_ps(a0, load32_bf16(xr + kk, k - kk), load32_bf16(wr + kk, k - kk));
        acc[j] = _mm512_add_ps(a0, a1);
      }
      alignas(64) float out[16];
      _mm512_store_ps(out, nanovllm::sum_each16(acc));
      c10::BFloat16* yr = y + r * n + first;
      for (int j = 0; j < count; ++j)
        yr[j] = static_cast<c10::BFloat16>(bias ? out[j] + static_cast<float>(bias[first + j]) : out[j]);
    }
  }
}

}  // namespace
#endif

bool gemv_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x [rows, K], weight [N, K], bias [N] or None, all bfloat16 and contiguous. Returns [rows, N].
at::Tensor gemv_bf16(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(gemv_available(), "gemv_bf16 needs a CPU with AVX-512 BF16");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "gemv_bf16: x [rows, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "gemv_bf16: x and weight must be bfloat16");
  TORCH_CHECK(weight.is_contiguous(), "gemv_bf16: weight must be contiguous");
  x = x.contiguous();
  const int64_t rows = x.size(0), n = weight.size(0), k = weight.size(1);
  const c10::BFloat16* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == n, "gemv_bf16: bias must be bfloat16 [N]");
    bias_c = bias->contiguous();
    b = bias_c.data_ptr<c10::BFloat16>();
  }
  auto y = at::empty({rows, n}, x.options());
#if defined(__AVX512BF16__)
  gemv_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), b, y.data_ptr<c10::BFloat16>(), rows, n, k);
#endif
  return y;
}

// Also a torch operator, torch.ops.nanovllm.gemv_bf16, so the profiler sees it as one op (a linear layer).
// Each ISA build registers its own namespace (NANOVLLM_OPS, set by nanovllm/kernels.py), so the builds for
// several levels load side by side in one process (the tests run every level the CPU supports).
#ifndef NANOVLLM_OPS
#define NANOVLLM_OPS nanovllm
#endif
TORCH_LIBRARY(NANOVLLM_OPS, m) { m.def("gemv_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(NANOVLLM_OPS, CPU, m) { m.impl("gemv_bf16", &gemv_bf16); }
