// Greedy sampling in one read of the logits: per row, the index of the largest value (the first one on ties,
// as torch.argmax) and whether the row holds a NaN or +inf (the sampler must never pick a token from such a
// row). torch needs a float32 copy of the bf16 logits, an isnan pass, an == inf pass and an argmax pass for
// this, each a full read of [rows, vocab]: at 64 rows x 49152 a large share of a decode step.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>

namespace {

using nanovllm::to_float;

template <typename scalar_t>
void argmax_row_scalar(const scalar_t* x, int64_t n, int64_t* index, bool* bad) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_i = 0;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    nan |= v != v;
    if (v > best) best = v, best_i = i;
  }
  *index = best_i;
  *bad = nan || best == std::numeric_limits<float>::infinity();
}

#if defined(__AVX512F__)
template <typename scalar_t>
void argmax_row_avx512(const scalar_t* x, int64_t n, int64_t* index, bool* bad) {
  const int64_t full = n / 16 * 16;
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t i = 0; i < full; i += 16) {  // pass 1: the maximum, and any NaN
    const __m512 v = nanovllm::load16(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  float best = _mm512_reduce_max_ps(mx);
  bool nan_tail = false;
  for (int64_t i = full; i < n; ++i) {
    const float v = to_float(x[i]);
    nan_tail |= v != v;
    best = v > best ? v : best;
  }
  // Pass 2: the first position holding the maximum (the row is in cache by now).
  int64_t best_i = 0;
  const __m512 target = _mm512_set1_ps(best);
  bool found = false;
  for (int64_t i = 0; i < full && !found; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(nanovllm::load16(x + i), target, _CMP_EQ_OQ);
    if (hit) best_i = i + __builtin_ctz(hit), found = true;
  }
  for (int64_t i = full; i < n && !found; ++i)
    if (to_float(x[i]) == best) best_i = i, found = true;
  *index = best_i;
  *bad = nan || nan_tail || best == std::numeric_limits<float>::infinity();
}
#endif

template <typename scalar_t>
void greedy_rows(const scalar_t* x, int64_t rows, int64_t vocab, int64_t* out, bool* flag) {
#pragma omp parallel for if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
      argmax_row_avx512<scalar_t>(x + r * vocab, vocab, out + r, flag + r);
      continue;
    }
#endif
    argmax_row_scalar<scalar_t>(x + r * vocab, vocab, out + r, flag + r);
  }
}

}  // namespace

// logits: [rows, vocab]. Returns (tokens int64 [rows], bad bool [rows]): the argmax of each row, and whether
// the row has a NaN or +inf logit (then its token is meaningless).
std::tuple<at::Tensor, at::Tensor> greedy_sample(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2, "greedy_sample: logits must be [rows, vocab]");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto tokens = at::empty({rows}, at::kLong);
  auto bad = at::empty({rows}, at::kBool);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "greedy_sample", [&] {
    greedy_rows<scalar_t>(logits.data_ptr<scalar_t>(), rows, vocab, tokens.data_ptr<int64_t>(),
                          bad.data_ptr<bool>());
  });
  return {tokens, bad};
}
