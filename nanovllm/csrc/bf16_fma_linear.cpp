// y = x W^T (+ b) in bfloat16 on CPUs without bf16 arithmetic (AVX2): bf16 weights, float32 multiply-adds.
//
// Below AVX-512, oneDNN has no bf16 GEMM, and torch's own (ATen's) bf16 matmul runs far below its float32 GEMM
// there, so a bf16 model ran slower than the same model in float32 (experiments/results/history_speed.md).
// Here the weights stay bf16 in memory (half float32's bytes: batch 1 is bound by reading them) and become
// float32 in registers, where bf16 is only float32's upper half: one shift or one mask per value, no rounding.
//
// Layout (pack_bf16_fma_weight, once at load): blocks of 16 output features, each K x 16 bf16, and within one k
// the features in the order f0, f8, f1, f9, ..., f7, f15. One 32-byte load then holds the block's 16 weights of
// that k, and as 8 32-bit lanes each lane is (f_j, f_8+j): shifting left by 16 gives features 0-7 as float32,
// masking off the low half gives features 8-15, with no shuffle.
//
// The loop: threads split the feature blocks evenly; for each block, x's rows (converted to float32 once per
// call) go in groups of up to 6: per k, one weight load and 2 integer ops feed 6 broadcasts of x and 12 FMAs
// into 12 accumulators (16 registers in all). The weight block (K x 32 bytes, <= 48 KB) is read from memory
// once per tile of rows and from L1/L2 by the other groups.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <omp.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kFmaFeatures = 16;  // output features per block
#if defined(__AVX2__)
constexpr int kMaxRows = 6;        // rows per group: 12 accumulators, 2 weight vectors and a broadcast
constexpr int64_t kRowTile = 64;   // rows per pass over a thread's feature blocks (x's float32 tile stays in L2)

// R rows of x (float32, row stride k) against one weight block over all of K; acc[r][h]: features 8h..8h+7.
// The sums live in locals until the end: written through acc in the loop, GCC stored them to memory on every k
// (half the speed).
template <int R>
inline void dot_block(const uint16_t* w, const float* x, int64_t k, __m256 (*acc)[2]) {
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 sums[R][2];
  for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kk * kFmaFeatures));
    const __m256 low = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));           // features 0-7
    const __m256 high = _mm256_castsi256_ps(_mm256_and_si256(pairs, high_half));    // features 8-15
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * k + kk);
      sums[r][0] = _mm256_fmadd_ps(low, xr, sums[r][0]);
      sums[r][1] = _mm256_fmadd_ps(high, xr, sums[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    acc[r][0] = sums[r][0];
    acc[r][1] = sums[r][1];
  }
}

// 8 float32 lanes rounded to bf16 as c10's conversion does: to nearest, ties to even, NaN to the quiet NaN.
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

void bf16_fma_rows(const float* x, const uint16_t* packed, const float* bias, uint16_t* y, int64_t m, int64_t n,
                   int64_t k) {
  const int64_t blocks = (n + kFmaFeatures - 1) / kFmaFeatures;
#pragma omp parallel
  {
    // An even, contiguous range of feature blocks per thread: at batch 1 the slower thread sets the layer's time.
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t begin = blocks * me / threads, end = blocks * (me + 1) / threads;
    for (int64_t t0 = 0; t0 < m; t0 += kRowTile) {
      const int64_t tile = std::min(kRowTile, m - t0);
      // Groups as even as the tile allows (8 rows: 4 + 4, not 6 + 2: a 2-row group reads the block at a third
      // of a 6-row group's arithmetic).
      const int64_t groups = (tile + kMaxRows - 1) / kMaxRows;
      for (int64_t fb = begin; fb < end; ++fb) {
        const uint16_t* w = packed + fb * k * kFmaFeatures;
        const int64_t col = fb * kFmaFeatures, count = std::min(kFmaFeatures, n - col);
        __m256 bias_lanes[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        if (bias != nullptr) {
          alignas(32) float b16[kFmaFeatures] = {};
          std::memcpy(b16, bias + col, count * sizeof(float));
          bias_lanes[0] = _mm256_load_ps(b16);
          bias_lanes[1] = _mm256_load_ps(b16 + 8);
        }
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r0 = t0 + tile * g / groups, rows = t0 + tile * (g + 1) / groups - r0;
          const float* xr = x + r0 * k;
          __m256 acc[kMaxRows][2];
          switch (rows) {
            case 6: dot_block<6>(w, xr, k, acc); break;
            case 5: dot_block<5>(w, xr, k, acc); break;
            case 4: dot_block<4>(w, xr, k, acc); break;
            case 3: dot_block<3>(w, xr, k, acc); break;
            case 2: dot_block<2>(w, xr, k, acc); break;
            default: dot_block<1>(w, xr, k, acc); break;
          }
          for (int64_t r = 0; r < rows; ++r) {
            const __m128i low = to_bf16(_mm256_add_ps(acc[r][0], bias_lanes[0]));
            const __m128i high = to_bf16(_mm256_add_ps(acc[r][1], bias_lanes[1]));
            uint16_t* dst = y + (r0 + r) * n + col;
            if (count == kFmaFeatures) {
              _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), low);
              _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 8), high);
            } else {
              alignas(16) uint16_t out[kFmaFeatures];
              _mm_store_si128(reinterpret_cast<__m128i*>(out), low);
              _mm_store_si128(reinterpret_cast<__m128i*>(out + 8), high);
              std::memcpy(dst, out, count * sizeof(uint16_t));
            }
          }
        }
      }
    }
  }
}
#endif

}  // namespace

// Whether this build has bf16_fma_linear: every build with AVX2 (the fast path runs it where the CPU has AVX2
// but no AVX-512, fast_path.linear_kernel).
bool bf16_fma_available() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

// The bf16 weight [N, K] in the kernel's layout: [ceil(N / 16), K * 16], features zero-padded to whole blocks and
// ordered f0, f8, f1, f9, ... within each k (the header says why). Called once per linear at load time.
at::Tensor pack_bf16_fma_weight(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16,
              "pack_bf16_fma_weight: weight must be a 2-D bfloat16 CPU tensor");
  const int64_t n = weight.size(0), k = weight.size(1), blocks = (n + kFmaFeatures - 1) / kFmaFeatures;
  auto padded = at::zeros({blocks * kFmaFeatures, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // [block][half h][j][k] -> [block][k][j][h]: feature 8h + j lands at 2j + h within each k.
  return padded.view({blocks, 2, kFmaFeatures / 2, k}).permute({0, 3, 2, 1}).contiguous()
      .view({blocks, k * kFmaFeatures});
}

// x [M, K] bfloat16 times the packed weight of ``out_features`` outputs (+ bias, float32), in bfloat16.
at::Tensor bf16_fma_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kBFloat16,
              "bf16_fma_linear: x must be a 2-D bfloat16 CPU tensor");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 2, "bf16_fma_linear: packed must be "
              "pack_bf16_fma_weight's bfloat16 [blocks, K * 16]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.size(1) == k * kFmaFeatures && packed.size(0) * kFmaFeatures >= out_features,
              "bf16_fma_linear: the packed weight does not match x's in_features (", k, ") or out_features (",
              out_features, ")");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == out_features &&
                                    bias->is_contiguous()),
              "bf16_fma_linear: bias must be a contiguous float32 tensor of out_features values");
#if defined(__AVX2__)
  auto y = at::empty({m, out_features}, x.options());
  if (m == 0) return y;
  const auto x_float = x.to(at::kFloat).contiguous();  // once per call, not once per feature block
  bf16_fma_rows(x_float.data_ptr<float>(), reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                bias.has_value() ? bias->data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()), m,
                out_features, k);
  return y;
#else
  TORCH_CHECK(false,
              "bf16_fma_linear: this kernel build has no AVX2 (the avx2, avx512 and avx512_bf16 builds have it)");
#endif
}

#ifndef NANOVLLM_OPS
#define NANOVLLM_OPS nanovllm
#endif
TORCH_LIBRARY_FRAGMENT(NANOVLLM_OPS, m) {
  m.def("bf16_fma_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(NANOVLLM_OPS, CPU, m) { m.impl("bf16_fma_linear", &bf16_fma_linear); }
