// Linear layers over quantized weights: y = x W^T (+ b), W in 8 or 4 bits, x quantized to int8 on the fly.
//
// Three weight formats (QuantFormat below), all with K a multiple of 32:
//   int8    W8A8: int8 [N, K] with one float32 scale per output channel (vLLM's int8 weights); x gets dynamic
//           scales per token and group of 32 values (finer than one scale per token, whose cost
//           docs/quantization.md measures), the channel's scale applied once at the end.
//   q8_0    GGUF's Q8_0 blocks: int8 [N, K] and one fp16 scale per 32 weights (w = d * q).
//   q4      GGUF's Q4_1 (and Q4_0, as Q4_1 with m = -8 d) blocks: 4-bit codes packed two to a byte [N, K / 2]
//           in GGUF's order (byte j of a block: element j in the low nibble, element j + 16 in the high one),
//           an fp16 scale d and offset m per 32 weights (w = d * q + m).
// x is quantized as llama.cpp does for the GGUF blocks (its Q8_1): per 32 values, int8 codes, a scale
// d_x = max|x| / 127 and s_x = d_x * sum(codes), so a block's contribution is d_w d_x sum(q p) + m_w s_x, the
// sum in integers.
//
// Why integers: on AVX2 one vpmaddubsw does 32 8-bit multiply-adds where an FMA does 8 float32 ones, so the
// layer is bound by reading its (4x or 8x smaller) weights at any small batch, not by arithmetic. The unpacking
// happens in registers: no dequantized copy of a weight ever exists. Work is split over tiles of output
// features; a tile's weights stay in L1 while every row of x passes over them, so W is read from memory once.
//
// Vector paths: AVX2 (the avx2 and avx512 builds); in the avx512_bf16 build (every CPU with AVX-512 BF16 has
// VNNI) two blocks per 512-bit register through VNNI's one-instruction byte dot product, the odd last block
// through the AVX2 loop with VNNI's 256-bit form; portable loops elsewhere (the scalar build). All compute the
// same integer sums; only the float rounding of the block sums' order differs. Every build with AVX2 also has
// q4x16_linear and i8x16_linear (below): Q4 and int8 weights moved at load into a layout interleaved by 16 output
// features, the layers' kernels there (the row kernel above stays for Q8_0 and the scalar build). On AMX CPUs
// int8 runs on the tiles instead (int8_amx.cpp).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "scratch.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;  // weights per block (GGUF's QK8_0 / QK4_1), values per activation block
enum QuantFormat : int64_t { kInt8 = 0, kQ8_0 = 1, kQ4 = 2 };
constexpr int64_t kTile = 8;  // output features per work item

inline float half_to_float(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

using nanovllm::to_float;  // cpu_vec.h's: a bf16's bits shifted into a float32's

// ---- activations -> int8 -----------------------------------------------------------------------------------

#if defined(__AVX2__)
using nanovllm::load8;  // cpu_vec.h: 8 values of x as float32 lanes
using nanovllm::max_each8;
using nanovllm::sum_each8i;
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline int hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_extracti128_si256(v, 1), _mm256_castsi256_si128(v));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX2__)
// max |x| over n values (n a multiple of 8), in 8 lanes (each the max of every 8th value).
template <typename T>
inline __m256 abs_max_lanes(const T* x, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, load8(x + i)));
  return m;
}
#endif

// max |x| over n values (n a multiple of 32).
template <typename T>
inline float abs_max(const T* x, int64_t n) {
#if defined(__AVX2__)
  return hmax8(abs_max_lanes(x, n));
#else
  float m = 0.f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(to_float(x[i])));
  return m;
#endif
}

#if defined(__AVX2__)
// 32 values to int8 codes round(x * mul) (round half to even) stored at q; returns the codes' sums in 8 lanes.
// The four 8-lane groups of codes are stored in order: two saturating packs interleave them per 128-bit half, one
// permute restores the order.
template <typename T>
inline __m256i quantize32_lanes(const T* x, __m256 mul, int8_t* q) {
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x), mul));
  const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + 8), mul));
  const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + 16), mul));
  const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + 24), mul));
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
}
#endif

// 32 values to int8 codes round(x * inv) (round half to even, both paths); returns the codes' sum.
template <typename T>
inline int quantize32(const T* x, float inv, int8_t* q) {
#if defined(__AVX2__)
  return hsum8i(quantize32_lanes(x, _mm256_set1_ps(inv), q));
#else
  int sum = 0;
  for (int i = 0; i < QK; ++i) {
    const int v = static_cast<int>(std::nearbyint(to_float(x[i]) * inv));
    q[i] = static_cast<int8_t>(v);
    sum += v;
  }
  return sum;
#endif
}

// A block's 32 codes split in nibbles for the AVX2 int8 layers (Int8x16Avx2): the high ones hi = (x + 8) >> 4 in
// [-8, 8], then the low ones x - 16 hi in [-8, 7].
inline void split_codes(const int8_t* codes, int8_t* split) {
  for (int i = 0; i < QK; ++i) {
    const int hi = (codes[i] + 8) >> 4;  // arithmetic shift: floor, for negative codes too
    split[i] = static_cast<int8_t>(hi);
    split[QK + i] = static_cast<int8_t>(codes[i] - 16 * hi);
  }
}

#if defined(__AVX2__)
// quantize_rows' work for 8 consecutive blocks of a row (256 values from x), bit for bit its per-block arithmetic:
// the eight abs-maxes, scales, inverses and code sums each take one vector op for all eight blocks, where block
// by block they took a horizontal reduction or a scalar division each (the quantizer's cost at a prefill's rows).
template <typename T>
inline void quantize8_blocks(const T* x, int8_t* q, float* d, float* s, int32_t* code_sums, int8_t* split) {
  __m256 peaks[8];
  for (int j = 0; j < 8; ++j) peaks[j] = abs_max_lanes(x + j * QK, QK);
  const __m256 amax = max_each8(peaks), c127 = _mm256_set1_ps(127.f);
  const __m256 scale = _mm256_div_ps(amax, c127);
  // 127 / amax, or 0 for an all-zero block (as the per-block path's amax > 0 test).
  const __m256 inv = _mm256_and_ps(_mm256_div_ps(c127, amax), _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ));
  alignas(32) float invs[8];
  _mm256_store_ps(invs, inv);
  __m256i sums[8];
  for (int j = 0; j < 8; ++j) {
    alignas(32) int8_t block[QK];  // the codes on their way to split
    sums[j] = quantize32_lanes(x + j * QK, _mm256_set1_ps(invs[j]), split != nullptr ? block : q + j * QK);
    if (split != nullptr) split_codes(block, split + j * 2 * QK);
  }
  const __m256i total = sum_each8i(sums);
  _mm256_storeu_ps(d, scale);
  _mm256_storeu_ps(s, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(total)));
  if (code_sums != nullptr) _mm256_storeu_si256(reinterpret_cast<__m256i*>(code_sums), _mm256_slli_epi32(total, 7));
}
#endif

// Per row, per 32 values: int8 codes, their scale d and s = d * sum(codes) (the Q4 offsets' share); with
// code_sums, also 128 * sum(codes) as an integer (i8x16's correction for its unsigned weights). With split, the
// codes go there split in nibbles ([rows, 2 K], split_codes) instead of to q, which may then be null.
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int8_t* q, float* d, float* s, int32_t* code_sums,
                   int8_t* split = nullptr) {
  const int64_t nb = k / QK;
#pragma omp parallel for if (rows > 8)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * k;
    int8_t* qr = q == nullptr ? nullptr : q + r * k;
    int64_t b = 0;
#if defined(__AVX2__)
    for (; b + 8 <= nb; b += 8)
      quantize8_blocks(xr + b * QK, qr == nullptr ? nullptr : qr + b * QK, d + r * nb + b, s + r * nb + b,
                       code_sums == nullptr ? nullptr : code_sums + r * nb + b,
                       split == nullptr ? nullptr : split + r * 2 * k + b * 2 * QK);
#endif
    for (; b < nb; ++b) {
      const float amax = abs_max(xr + b * QK, QK);
      const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      d[r * nb + b] = scale;
      alignas(32) int8_t block[QK];  // the codes on their way to split
      int8_t* codes = split != nullptr ? block : qr + b * QK;
      const int sum = quantize32(xr + b * QK, inv, codes);
      s[r * nb + b] = scale * static_cast<float>(sum);
      if (code_sums != nullptr) code_sums[r * nb + b] = 128 * sum;
      if (split != nullptr) split_codes(codes, split + r * 2 * k + b * 2 * QK);
    }
  }
}

// ---- one weight row . a group of activation rows -----------------------------------------------------------
//
// Each weight block is unpacked once and then multiplied with up to kGroup rows of x, so the unpacking and the
// weight scales are paid once per group; the group's accumulators stay in registers.

constexpr int kGroup = 4;

#if defined(__AVX2__)
// 32 unsigned x 32 signed bytes -> 8 int32 sums of four products each: one VNNI instruction where the build
// has AVX-512 VNNI, else AVX2's two (their 16-bit intermediate sums cannot saturate: |w| <= 128, |x| <= 127,
// and the 4-bit codes are below 16, so both give the same integers).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Two blocks per 512-bit register (the avx512_bf16 build): half the instructions per weight of the 256-bit
// loops, which at batch 1 are bound by instructions, not by reading the weights.
#define NANOVLLM_QUANT_512 1
inline __m512i load64(const int8_t* p) { return _mm512_loadu_si512(p); }
// (a, a, ..., b, b, ...): 8 lanes of each block's combined scale, in the lanes of its 8 int32 sums.
inline __m512 pair_scale(float a, float b) {
  return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

// pair(b, into) adds blocks b and b+1 of R rows into into[0..R); this runs it over the pairs of [0, nb), into two
// accumulator sets by turns (one chain of dependent FMAs per weight row would leave a batch-1 loop waiting on
// their latency), folds both into acc's 8 lanes per row and returns the first block left (nb, or the odd one).
template <int R, typename Pair>
inline int64_t over_block_pairs(int64_t nb, Pair&& pair, __m256* acc) {
  __m512 wide[R], wide2[R];
  for (int r = 0; r < R; ++r) wide[r] = wide2[r] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    pair(b, wide);
    pair(b + 2, wide2);
  }
  if (b + 2 <= nb) {
    pair(b, wide);
    b += 2;
  }
  for (int r = 0; r < R; ++r) {
    const __m512 sum = _mm512_add_ps(wide[r], wide2[r]);
    acc[r] = _mm256_add_ps(_mm512_castps512_ps256(sum), _mm512_extractf32x8_ps(sum, 1));
  }
  return b;
}
#endif

// int8 codes against x's: sum over blocks of d_w d_x (w . x); wd: the row's block scales as float32 (Q8_0), or
// null for int8 per channel (d_w = 1 here; the caller multiplies by the channel's scale).
template <int R>
inline void dot_q8_0(const int8_t* w, const float* wd, const int8_t* x, int64_t k, const float* xd, int64_t nb,
                     float* out) {
#if defined(__AVX2__)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t b = 0;
#if defined(NANOVLLM_QUANT_512)
  {
    auto pair = [&](int64_t pb, __m512* into) {
      // AVX-512 has no byte sign instruction: |w| unsigned, and x negated where w is negative, by a mask.
      const __m512i wv = load64(w + pb * QK);
      const __m512i wabs = _mm512_abs_epi8(wv);
      const __mmask64 negative = _mm512_movepi8_mask(wv);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = load64(x + r * k + pb * QK);
        const __m512i xs = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
        const __m512 sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wabs, xs));
        const float* d = xd + r * nb + pb;
        const __m512 scale = wd != nullptr ? pair_scale(wd[pb] * d[0], wd[pb + 1] * d[1]) : pair_scale(d[0], d[1]);
        into[r] = _mm512_fmadd_ps(sums, scale, into[r]);
      }
    };
    b = over_block_pairs<R>(nb, pair, acc);
  }
#endif
  for (; b < nb; ++b) {
    const __m256i wv = load32(w + b * QK);
    const __m256i wabs = _mm256_sign_epi8(wv, wv);
    for (int r = 0; r < R; ++r) {
      const __m256 sums = _mm256_cvtepi32_ps(dot_u8s8(wabs, _mm256_sign_epi8(load32(x + r * k + b * QK), wv)));
      acc[r] = _mm256_fmadd_ps(sums, _mm256_set1_ps(wd != nullptr ? wd[b] * xd[r * nb + b] : xd[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]);
#else
  for (int r = 0; r < R; ++r) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      int32_t sum = 0;
      for (int64_t i = 0; i < QK; ++i) sum += static_cast<int32_t>(w[b * QK + i]) * x[r * k + b * QK + i];
      acc += static_cast<float>(sum) * (wd != nullptr ? wd[b] * xd[r * nb + b] : xd[r * nb + b]);
    }
    out[r] = acc;
  }
#endif
}

// Q4 (Q4_1, Q4_0): sum over blocks of d_w d_x (q . x) + m_w s_x; wd, wm: the row's scales and offsets as float32.
template <int R>
inline void dot_q4(const uint8_t* w, const float* wd, const float* wm, const int8_t* x, int64_t k, const float* xd,
                   const float* xs, int64_t nb, float* out) {
  for (int r = 0; r < R; ++r) {  // the offsets' share: a plain dot product over the blocks
    float offsets = 0.f;
#pragma omp simd reduction(+ : offsets)
    for (int64_t b = 0; b < nb; ++b) offsets += wm[b] * xs[r * nb + b];
    out[r] = offsets;
  }
#if defined(__AVX2__)
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t b = 0;
#if defined(NANOVLLM_QUANT_512)
  {
    const __m512i low4_512 = _mm512_set1_epi8(0x0F);
    auto pair = [&](int64_t pb, __m512* into) {
      // Two blocks' 32 bytes -> (b low, b+1 low | b high, b+1 high) -> each block's elements 0..31 in order.
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + pb * QK / 2));
      const __m512i halves = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
      const __m512i codes = _mm512_and_si512(_mm512_shuffle_i64x2(halves, halves, _MM_SHUFFLE(3, 1, 2, 0)),
                                             low4_512);
      for (int r = 0; r < R; ++r) {
        const __m512 sums =
            _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, load64(x + r * k + pb * QK)));
        const float* d = xd + r * nb + pb;
        into[r] = _mm512_fmadd_ps(sums, pair_scale(wd[pb] * d[0], wd[pb + 1] * d[1]), into[r]);
      }
    };
    b = over_block_pairs<R>(nb, pair, acc);
  }
#endif
  for (; b < nb; ++b) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * QK / 2));
    // Low nibbles are elements 0..15 of the block, high nibbles 16..31: one 256-bit register in element order.
    const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
    for (int r = 0; r < R; ++r) {
      const __m256 sums = _mm256_cvtepi32_ps(dot_u8s8(codes, load32(x + r * k + b * QK)));
      acc[r] = _mm256_fmadd_ps(sums, _mm256_set1_ps(wd[b] * xd[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] += hsum8(acc[r]);
#else
  for (int r = 0; r < R; ++r) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = w + b * QK / 2;
      const int8_t* xb = x + r * k + b * QK;
      int32_t sum = 0;
      for (int64_t j = 0; j < QK / 2; ++j) sum += (wb[j] & 0x0F) * xb[j] + (wb[j] >> 4) * xb[j + QK / 2];
      acc += static_cast<float>(sum) * (wd[b] * xd[r * nb + b]);
    }
    out[r] += acc;
  }
#endif
}

// float32 copies of n float16 values (the scales of one tile of weight rows, converted once per tile).
inline void halves_to_floats(const at::Half* h, int64_t n, float* f) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < n; ++i) f[i] = half_to_float(h[i]);
}

struct Weights {
  QuantFormat format;
  const void* codes;
  const void* scales;  // float32 [N] (int8) or float16 [N, nb]
  const at::Half* mins;
};

// R rows of x (starting at row r0) against weight row j; out[r] for r < R.
template <int R>
inline void dot_rows(const Weights& wt, int64_t j, int64_t tile_row, const float* wd, const float* wm,
                     const int8_t* xq, const float* xd, const float* xs, int64_t r0, int64_t k, float* out) {
  const int64_t nb = k / QK;
  if (wt.format == kInt8) {
    dot_q8_0<R>(static_cast<const int8_t*>(wt.codes) + j * k, nullptr, xq + r0 * k, k, xd + r0 * nb, nb, out);
    for (int r = 0; r < R; ++r) out[r] *= static_cast<const float*>(wt.scales)[j];
  } else if (wt.format == kQ8_0) {
    dot_q8_0<R>(static_cast<const int8_t*>(wt.codes) + j * k, wd + tile_row * nb, xq + r0 * k, k, xd + r0 * nb, nb,
                out);
  } else {
    dot_q4<R>(static_cast<const uint8_t*>(wt.codes) + j * k / 2, wd + tile_row * nb, wm + tile_row * nb,
              xq + r0 * k, k, xd + r0 * nb, xs + r0 * nb, nb, out);
  }
}

template <typename T>
void quant_gemm(int64_t rows, int64_t k, int64_t n, const Weights& wt, const T* bias, T* y, const int8_t* xq,
                const float* xd, const float* xs) {
  const int64_t nb = k / QK;
  const int64_t tiles = (n + kTile - 1) / kTile;
  const bool blocked = wt.format != kInt8;
#pragma omp parallel
  {
    // This thread's float32 copy of a tile's block scales and offsets.
    std::vector<float> wd(blocked ? kTile * nb : 0), wm(wt.format == kQ4 ? kTile * nb : 0);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t first = t * kTile, last = std::min(n, first + kTile);
      if (blocked) halves_to_floats(static_cast<const at::Half*>(wt.scales) + first * nb, (last - first) * nb, wd.data());
      if (wt.format == kQ4) halves_to_floats(wt.mins + first * nb, (last - first) * nb, wm.data());
      float out[kGroup];
      for (int64_t r0 = 0; r0 < rows; r0 += kGroup) {
        const int64_t group = std::min<int64_t>(kGroup, rows - r0);
        for (int64_t j = first; j < last; ++j) {
          switch (group) {
            case 4: dot_rows<4>(wt, j, j - first, wd.data(), wm.data(), xq, xd, xs, r0, k, out); break;
            case 3: dot_rows<3>(wt, j, j - first, wd.data(), wm.data(), xq, xd, xs, r0, k, out); break;
            case 2: dot_rows<2>(wt, j, j - first, wd.data(), wm.data(), xq, xd, xs, r0, k, out); break;
            default: dot_rows<1>(wt, j, j - first, wd.data(), wm.data(), xq, xd, xs, r0, k, out); break;
          }
          for (int64_t r = 0; r < group; ++r)
            y[(r0 + r) * n + j] = static_cast<T>(bias != nullptr ? out[r] + to_float(bias[j]) : out[r]);
        }
      }
    }
  }
}

// ---- sharing an x16 layer's feature blocks between threads -------------------------------------------------

// A thread's remaining feature blocks [begin, end) in x16_gemm and x16_gemm_avx2: the owner takes items from the front, a thread
// done with its own range takes them from the back. Both ends live in one word, so a take is one compare-and-swap.
class alignas(64) BlockRange {  // a cache line each: the threads take items without sharing lines
 public:
  void reset(int64_t begin, int64_t end) { span_.store(pack(begin, end), std::memory_order_relaxed); }
  // The next item (up to `most` blocks) from the front: false when none is left.
  bool take_front(int64_t most, int64_t& first, int64_t& blocks) { return take(most, false, first, blocks); }
  // An item (up to `most` blocks) from the back: false when none is left.
  bool take_back(int64_t most, int64_t& first, int64_t& blocks) { return take(most, true, first, blocks); }
  // The blocks of the item the front would give next (0 when none is left).
  int64_t front_blocks(int64_t most) const {
    const uint64_t now = span_.load(std::memory_order_relaxed);
    const int64_t begin = now >> 32, end = now & 0xFFFFFFFFu;
    return std::max<int64_t>(std::min(most, end - begin), 0);
  }

 private:
  bool take(int64_t most, bool from_back, int64_t& first, int64_t& blocks) {
    uint64_t now = span_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t begin = now >> 32, end = now & 0xFFFFFFFFu;
      if (begin >= end) return false;
      blocks = std::min(most, end - begin);
      const uint64_t rest = from_back ? pack(begin, end - blocks) : pack(begin + blocks, end);
      if (span_.compare_exchange_weak(now, rest, std::memory_order_relaxed)) {
        first = from_back ? end - blocks : begin;
        return true;
      }
    }
  }
  static uint64_t pack(int64_t begin, int64_t end) { return static_cast<uint64_t>(begin) << 32 | static_cast<uint64_t>(end); }
  std::atomic<uint64_t> span_{0};
};

// The work of one x16 layer call: per tile of rows, one BlockRange per thread the parallel region may have,
// each starting as an even, contiguous share of the `used` feature blocks. A thread takes items from the front
// of its own range, then from the back of the others' (a range whose thread the team lacks is drained by the
// others), so a thread slowed by a neighbour on a shared machine does not hold the layer up.
class TileRanges {
 public:
  TileRanges(int64_t tiles, int64_t used) : team_(omp_get_max_threads()) {
    if (tiles * team_ > kStackRanges) {
      on_heap_ = std::vector<BlockRange>(tiles * team_);
      ranges_ = on_heap_.data();
    }
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t i = 0; i < team_; ++i) ranges_[t * team_ + i].reset(used * i / team_, used * (i + 1) / team_);
  }
  // Thread `me`'s next item of tile `tile` (up to `most` blocks): its own range's front, else another's back,
  // starting the search at `victim` (me at first; the caller keeps it between calls). False when none is left.
  bool take(int64_t tile, int64_t me, int64_t most, int64_t& victim, int64_t& first, int64_t& blocks) {
    BlockRange* const tile_ranges = ranges_ + tile * team_;
    for (int64_t tries = 0; tries < team_; ++tries) {
      if (victim == me ? tile_ranges[me].take_front(most, first, blocks)
                       : tile_ranges[victim].take_back(most, first, blocks))
        return true;
      victim = (victim + 1) % team_;
    }
    return false;
  }
  // The blocks thread `me`'s next own item in tile `tile` would hold (0 when its range is empty).
  int64_t next_own(int64_t tile, int64_t me, int64_t most) const { return ranges_[tile * team_ + me].front_blocks(most); }

 private:
  static constexpr int64_t kStackRanges = 16;  // ranges kept on the stack (tiles x threads): a decode's, no heap
  int64_t team_;
  BlockRange on_stack_[kStackRanges];
  std::vector<BlockRange> on_heap_;
  BlockRange* ranges_ = on_stack_;
};

// ---- Q4 interleaved by 16 output features (q4x16_linear, the avx512_bf16 build) ----------------------------
//
// The same Q4 blocks, laid out at load so that one 512-bit load holds 4 consecutive codes of 16 output features
// (pack_q4x16 in nanovllm/models/quantized.py): per block of 16 features and 32 values of K, 256 bytes
// [v = 0..3][feature 0..15][i = 0..3] of GGUF's byte 4v + i (low nibble: element 4v + i, high: 16 + 4v + i);
// the fp16 scales and offsets [feature block][K block][16]. Each of x's 4-byte groups is broadcast and one
// vpdpbusd adds its 4 products to all 16 features' int32 sums at once: no horizontal sums, and the block's
// float epilogue is one vector of 16 scales. Threads split the feature blocks evenly, in chunks of up to 4 (N is
// padded to 64 at load).
#if defined(NANOVLLM_QUANT_512)
#define NANOVLLM_Q4X16 1
constexpr int64_t kX16Features = 16, kX16Blocks = 4;  // features per block, blocks per work item
constexpr int64_t kX16TileBytes = 256 * 1024;  // x's codes per tile of rows: a quarter of the smallest L2 (1 MB)

// A share of the next work item's weights, fetched into L2 a few cache lines per block of K while a pass runs
// from cache. From 5 rows on, a work item's weights are read from memory by its first group of rows only, and
// that pass waits on memory while the other groups compute from cache; spreading the next item's loads over
// this item's passes overlaps the two. (The hardware prefetchers follow each stream only once it runs.)
struct NextWeights {
  const uint8_t* at = nullptr;   // this pass's share (nullptr: none)
  const uint8_t* end = nullptr;  // the end of the next item's codes
  int64_t lines = 0;             // cache lines per block of K

  // The next item's `bytes` of codes from `codes`, shared out over `passes` passes of nb blocks of K each (none
  // when there is no next item or a single pass: then nothing runs from cache to overlap with).
  static NextWeights plan(const uint8_t* codes, int64_t bytes, int64_t passes, int64_t nb) {
    NextWeights next;
    if (passes > 1 && bytes > 0) {
      next.at = codes;
      next.end = codes + bytes;
      next.lines = (bytes / 64 + passes * nb - 1) / (passes * nb);
    }
    return next;
  }
  // Pass i's share.
  NextWeights share(int64_t i, int64_t nb) const {
    NextWeights mine = *this;
    if (lines > 0) mine.at = at + i * nb * lines * 64;
    return mine;
  }
  void fetch(int64_t b) const {
    const uint8_t* p = at + b * lines * 64;
    for (int64_t i = 0; i < lines && p < end; ++i, p += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
  }
};

// R rows of x against FB consecutive feature blocks (R * FB <= 4: 2 int32 chains per row and block stay in
// registers). acc[r][f]: 16 features' float results, accumulated over K.
template <int R, int FB>
inline void dot_q4x16(const uint8_t* codes, const at::Half* scales, const at::Half* mins, int64_t block_stride,
                      const int8_t* x, int64_t k, const float* xd, const float* xs, int64_t nb, __m512* acc,
                      const NextWeights& next) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 total[R * FB];  // in registers for the whole pass (as dot_i8x16's)
  for (int i = 0; i < R * FB; ++i) total[i] = acc[i];
  for (int64_t b = 0; b < nb; ++b) {
    next.fetch(b);
    __m512i lo[R][FB], hi[R][FB];
    for (int r = 0; r < R; ++r)
      for (int f = 0; f < FB; ++f) lo[r][f] = hi[r][f] = _mm512_setzero_si512();
    for (int v = 0; v < 4; ++v) {
      __m512i xlo[R], xhi[R];
      for (int r = 0; r < R; ++r) {
        int32_t a, c;
        std::memcpy(&a, x + r * k + b * QK + 4 * v, 4);
        std::memcpy(&c, x + r * k + b * QK + 16 + 4 * v, 4);
        xlo[r] = _mm512_set1_epi32(a);
        xhi[r] = _mm512_set1_epi32(c);
      }
      for (int f = 0; f < FB; ++f) {
        const __m512i raw = _mm512_loadu_si512(codes + f * block_stride + b * 256 + 64 * v);
        const __m512i cl = _mm512_and_si512(raw, low4), ch = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        for (int r = 0; r < R; ++r) {
          lo[r][f] = _mm512_dpbusd_epi32(lo[r][f], cl, xlo[r]);
          hi[r][f] = _mm512_dpbusd_epi32(hi[r][f], ch, xhi[r]);
        }
      }
    }
    for (int f = 0; f < FB; ++f) {
      const int64_t at = f * (block_stride / 16) + b * kX16Features;  // the block's 16 scales (fp16)
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + at)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + at)));
      for (int r = 0; r < R; ++r) {
        const __m512 sums = _mm512_cvtepi32_ps(_mm512_add_epi32(lo[r][f], hi[r][f]));
        __m512& a = total[r * FB + f];
        a = _mm512_fmadd_ps(sums, _mm512_mul_ps(d, _mm512_set1_ps(xd[r * nb + b])), a);
        a = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * nb + b]), a);
      }
    }
  }
  for (int i = 0; i < R * FB; ++i) acc[i] = total[i];
}

inline void store16_out(__m512 v, float* out, int64_t count) {
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << count) - 1), v);
}
inline void store16_out(__m512 v, c10::BFloat16* out, int64_t count) {
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  _mm256_mask_storeu_epi16(out, static_cast<__mmask16>((1u << count) - 1), h);
}
inline __m512 load16_bias(const float* b) { return _mm512_loadu_ps(b); }
inline __m512 load16_bias(const c10::BFloat16* b) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))), 16));
}

// The Q4 layer for x16_gemm: codes [blocks][K / 32][256 bytes], fp16 scales and offsets [blocks][K / 32][16].
struct Q4x16Weights {
  static constexpr bool kPairsOfBlocks = false;  // 3-4 rows take one feature block a pass (registers)
  static constexpr int64_t kCodeBytes = 256;      // per feature block and block of K
  const uint8_t* codes;
  const at::Half *scales, *mins;
  int64_t nb;  // blocks of 32 along K

  template <int R, int FB>
  void dot(int64_t fb, const int8_t* x, int64_t k, const float* xd, const float* xs, const int32_t*,
           __m512* acc, const NextWeights& next) const {
    dot_q4x16<R, FB>(codes + fb * nb * 256, scales + fb * nb * kX16Features, mins + fb * nb * kX16Features,
                     nb * 256, x, k, xd, xs, nb, acc, next);
  }
  __m512 finish(__m512 v, int64_t) const { return v; }  // the scales are inside every block's sum
};

// ---- int8 interleaved by 16 output features (i8x16_linear, the avx512_bf16 build) ---------------------------
//
// quantization=int8's weights (one float32 scale per output channel) in the Q4 kernel's scheme, where a CPU has
// VNNI but no AMX: per block of 16 features and 32 values of K, 512 bytes [v = 0..7][feature 0..15][i = 0..3] of
// w[feature][4 v + i] + 128 (pack_i8x16 in nanovllm/models/quantized.py). vpdpbusd multiplies unsigned by
// signed bytes, so the weights are stored unsigned and x stays signed: sum x (w + 128) = sum x w + 128 sum x,
// and the second term, 128 times the block's sum of x's codes, is subtracted in integers. The sums are then
// exactly the vector kernel's (quant_linear); the channel scale multiplies once at the end. Against that kernel,
// which takes each weight row on its own (a horizontal sum per row and block), this one needs no horizontal sum
// and reads a weight byte once per group of rows, like q4x16.
template <int R, int FB>
inline void dot_i8x16(const uint8_t* codes, int64_t block_stride, const int8_t* x, int64_t k, const float* xd,
                      const int32_t* xc, int64_t nb, __m512* acc, const NextWeights& next) {
  // Up to 4 chains (R * FB <= 4), two int32 chains per row and block (v even and odd) hide vpdpbusd's latency;
  // from 8 on, one each (8 independent chains are enough, and 16 would not fit the registers).
  constexpr bool kTwoChains = R * FB <= 4;
  // The float sums live in registers for the whole pass: through acc, every block would store them again
  // (x's int8_t loads may alias acc as far as the compiler knows).
  __m512 total[R * FB];
  for (int i = 0; i < R * FB; ++i) total[i] = acc[i];
  for (int64_t b = 0; b < nb; ++b) {
    next.fetch(b);
    __m512i even[R][FB], odd[R][FB];
    for (int r = 0; r < R; ++r)
      for (int f = 0; f < FB; ++f) {
        even[r][f] = _mm512_setzero_si512();
        if constexpr (kTwoChains) odd[r][f] = _mm512_setzero_si512();
      }
    for (int v = 0; v < 8; v += 2) {
      __m512i x0[R], x1[R];
      for (int r = 0; r < R; ++r) {
        int32_t a, c;
        std::memcpy(&a, x + r * k + b * QK + 4 * v, 4);
        std::memcpy(&c, x + r * k + b * QK + 4 * v + 4, 4);
        x0[r] = _mm512_set1_epi32(a);
        x1[r] = _mm512_set1_epi32(c);
      }
      for (int f = 0; f < FB; ++f) {
        const uint8_t* block = codes + f * block_stride + b * 512 + 64 * v;
        const __m512i w0 = _mm512_loadu_si512(block), w1 = _mm512_loadu_si512(block + 64);
        for (int r = 0; r < R; ++r) {
          even[r][f] = _mm512_dpbusd_epi32(even[r][f], w0, x0[r]);
          if constexpr (kTwoChains) odd[r][f] = _mm512_dpbusd_epi32(odd[r][f], w1, x1[r]);
          else even[r][f] = _mm512_dpbusd_epi32(even[r][f], w1, x1[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_set1_ps(xd[r * nb + b]);
      // The correction for the unsigned weights: sum x (w + 128) - 128 sum x = sum x w. Subtracted here, not
      // used as the chains' start: a start shared by FB chains cost a register copy per chain and block.
      const __m512i correction = _mm512_set1_epi32(xc[r * nb + b]);
      for (int f = 0; f < FB; ++f) {
        const __m512i sums = _mm512_sub_epi32(kTwoChains ? _mm512_add_epi32(even[r][f], odd[r][f]) : even[r][f],
                                              correction);
        total[r * FB + f] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, total[r * FB + f]);
      }
    }
  }
  for (int i = 0; i < R * FB; ++i) acc[i] = total[i];
}

// The int8 layer for x16_gemm: codes [blocks][K / 32][512 bytes], channel scales float32 [16 blocks].
struct I8x16Weights {
  static constexpr bool kPairsOfBlocks = true;  // 3-4 rows take two feature blocks a pass: x broadcast once for both
  static constexpr int64_t kCodeBytes = 512;     // per feature block and block of K
  const uint8_t* codes;
  const float* channel_scales;
  int64_t nb;

  template <int R, int FB>
  void dot(int64_t fb, const int8_t* x, int64_t k, const float* xd, const float*, const int32_t* xc,
           __m512* acc, const NextWeights& next) const {
    dot_i8x16<R, FB>(codes + fb * nb * 512, nb * 512, x, k, xd, xc, nb, acc, next);
  }
  __m512 finish(__m512 v, int64_t fb) const {
    return _mm512_mul_ps(v, _mm512_loadu_ps(channel_scales + fb * kX16Features));
  }
};

// FB = 1..4 consecutive feature blocks from fb for R rows, as W::dot<R, FB> (a chunk's feature-block count is
// known at run time only at the end of a thread's range).
template <int R, typename W>
inline void dot_x16_chunk(const W& w, int64_t blocks, int64_t fb, const int8_t* x, int64_t k, const float* d,
                          const float* s, const int32_t* c, __m512* acc, const NextWeights& next) {
  switch (blocks) {
    case 4: if constexpr (R * 4 <= 4) w.template dot<R, 4>(fb, x, k, d, s, c, acc, next); break;
    case 3: if constexpr (R * 3 <= 4) w.template dot<R, 3>(fb, x, k, d, s, c, acc, next); break;
    case 2: if constexpr (R * 2 <= 4) w.template dot<R, 2>(fb, x, k, d, s, c, acc, next); break;
    default: w.template dot<R, 1>(fb, x, k, d, s, c, acc, next); break;
  }
}

// R (1-4) rows of x against `width` consecutive feature blocks from fb (width <= 2, or up to 4 for one row),
// over all of K: the register blocking each row count takes (W::dot<R, FB>, R * FB <= 4 or 8 for pairs).
template <typename W>
inline void dot_x16_rows(const W& w, int64_t group, int64_t width, int64_t fb, const int8_t* x, int64_t k,
                         const float* d, const float* s, const int32_t* c, __m512* acc, const NextWeights& next) {
  if (group == 1) {
    dot_x16_chunk<1>(w, width, fb, x, k, d, s, c, acc, next);
  } else if (group == 2) {
    dot_x16_chunk<2>(w, width, fb, x, k, d, s, c, acc, next);
  } else if (width == 2) {
    if constexpr (W::kPairsOfBlocks) {
      if (group == 4) w.template dot<4, 2>(fb, x, k, d, s, c, acc, next);
      else w.template dot<3, 2>(fb, x, k, d, s, c, acc, next);
    }
  } else if (group == 4) {
    w.template dot<4, 1>(fb, x, k, d, s, c, acc, next);
  } else {
    w.template dot<3, 1>(fb, x, k, d, s, c, acc, next);
  }
}

// y = x W^T (+ bias) over a layer interleaved by 16 features (Q4x16Weights or I8x16Weights); xq, xd, xs, xc: x's
// codes, block scales, scaled code sums (Q4's offsets) and 128 x code sums (int8's correction).
template <typename T, typename W>
void x16_gemm(int64_t rows, int64_t k, int64_t n, const W& w, const T* bias, T* y, const int8_t* xq,
              const float* xd, const float* xs, const int32_t* xc) {
  const int64_t nb = k / QK;
  const int64_t used = (n + kX16Features - 1) / kX16Features;  // feature blocks holding real outputs
  // Feature blocks a pass takes: all of a work item for one row; else 2 (int8: a pair shares each broadcast of
  // x) or 1 (Q4 at 3-4 rows: the registers).
  const int64_t slice = rows == 1 ? kX16Blocks : (rows == 2 || W::kPairsOfBlocks ? 2 : 1);
  // Rows in tiles whose codes stay in L2 while every feature block passes over them (a prefill's x, 1600 rows x
  // K bytes, would otherwise come from L3 again for every slice of every work item); a decode's rows are one tile.
  const int64_t tile_rows = std::max<int64_t>(4, kX16TileBytes / k / 4 * 4), tiles = (rows + tile_rows - 1) / tile_rows;
  TileRanges work(tiles, used);
#pragma omp parallel
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t tile_begin = tile * tile_rows, tile_end = std::min(rows, tile_begin + tile_rows);
    // Work items of up to 4 feature blocks (the register blocking) from each thread's even share (TileRanges):
    // with whole 4-block items a 576-wide layer (36 blocks, 9 items) would split 5:4 over two threads, and at
    // batch 1 the slower thread sets the layer's time.
    const int64_t me = omp_get_thread_num();
    int64_t fb0 = 0, blocks = 0;
    for (int64_t victim = me; work.take(tile, me, kX16Blocks, victim, fb0, blocks);) {
      // With more than one group of rows, this item's passes share out the next item's weights (NextWeights):
      // the owner's next item (a thief's next one is not known).
      const int64_t slices = (blocks + slice - 1) / slice, groups = (tile_end - tile_begin + 3) / 4;
      const int64_t next_blocks = victim == me ? work.next_own(tile, me, kX16Blocks) : 0;
      const int64_t passes = groups > 1 ? slices * groups : 1;
      const int64_t block_bytes = nb * W::kCodeBytes;  // one feature block's codes
      const NextWeights next =
          NextWeights::plan(w.codes + (fb0 + blocks) * block_bytes, next_blocks * block_bytes, passes, nb);
      int64_t pass = 0;
      // A slice of the item's features at a time, every group of rows through it: the slice's weights (2 x 16
      // features x K bytes, 18 KB at K = 576) stay in L1 while the rows pass, where taking every slice per
      // group of rows read the whole item's weights (36 KB) from L2 again for each group.
      for (int64_t f = 0; f < blocks; f += slice) {
        const int64_t width = std::min<int64_t>(slice, blocks - f);
        for (int64_t r0 = tile_begin; r0 < tile_end; r0 += 4) {
          const int64_t group = std::min<int64_t>(4, tile_end - r0);
          __m512 acc[4 * kX16Blocks];  // [row][feature block of the slice]
          for (auto& a : acc) a = _mm512_setzero_ps();
          dot_x16_rows(w, group, width, fb0 + f, xq + r0 * k, k, xd + r0 * nb, xs + r0 * nb,
                       xc == nullptr ? nullptr : xc + r0 * nb, acc, next.share(pass++, nb));
          for (int64_t r = 0; r < group; ++r) {
            for (int64_t j = 0; j < width; ++j) {
              const int64_t col = (fb0 + f + j) * kX16Features;
              if (col >= n) break;
              const int64_t count = std::min(kX16Features, n - col);
              __m512 v = w.finish(acc[r * width + j], fb0 + f + j);
              if (bias != nullptr) {
                if (count == kX16Features) {
                  v = _mm512_add_ps(v, load16_bias(bias + col));
                } else {
                  alignas(64) float b16[kX16Features] = {};
                  for (int64_t i = 0; i < count; ++i) b16[i] = to_float(bias[col + i]);
                  v = _mm512_add_ps(v, _mm512_load_ps(b16));
                }
              }
              store16_out(v, y + (r0 + r) * n + col, count);
            }
          }
        }
      }
    }
  }
}
#elif defined(__AVX2__)
// ---- Q4 and int8 interleaved by 16 output features on AVX2 (the avx2 and avx512 builds) --------------------
//
// The layouts above, without VNNI. 16 features are two 256-bit halves; two rows a pass keep the 15 registers
// the kernels need. Both add a block's byte products up in int16 with vpmaddubsw, then into int32 per feature:
// - Q4: vpmaddubsw multiplies the unsigned codes by x's signed bytes and adds pairs into int16
//   (|pair| <= 2 * 15 * 127 = 3810); a block's 8 such products per lane (4 groups of K, low and high nibbles) add
//   up in int16 without saturating (<= 30480 < 32767), and one vpmaddwd by ones gives the int32 block sums.
// - int8: the stored w + 128 times a full code would saturate a pair (2 * 255 * 127 > 32767), so x comes split
//   in two nibbles of at most 8 in size, each a product of its own (Int8x16Avx2 below).
#define NANOVLLM_X16_AVX2 1
constexpr int64_t kX16Features = 16, kX16Blocks = 4;  // features per block; N is padded to 4 blocks at load
constexpr int64_t kX16RowTile = 64;  // rows per pass over a thread's feature blocks (x's tile stays in L2)

// The Q4 layer (pack_q4x16): R (1 or 2) rows of x against feature block fb over all of K; acc[r][h]: features
// 8h..8h+7, the scales and offsets inside every block's sum.
struct Q4x16Avx2 {
  const uint8_t* codes;
  const at::Half *scales, *mins;
  int64_t nb;

  static constexpr int64_t kCodeStride = 1;  // x's row stride in units of K: its codes as quantize_rows wrote them

  template <int R>
  void dot(int64_t fb, const int8_t* x, int64_t k, const float* xd, const float* xs, const int32_t*,
           __m256 (*acc)[2]) const {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const uint8_t* fb_codes = codes + fb * nb * 256;
    for (int64_t b = 0; b < nb; ++b) {
      __m256i sums[R][2];
      for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 2  // as in I8x16Avx2::dot: fully unrolled, GCC hoists the loads and spills the block sums
      for (int v = 0; v < 4; ++v) {
        const uint8_t* block = fb_codes + b * 256 + 64 * v;
        const __m256i raw0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
        const __m256i raw1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32));
        const __m256i lo0 = _mm256_and_si256(raw0, low4), hi0 = _mm256_and_si256(_mm256_srli_epi16(raw0, 4), low4);
        const __m256i lo1 = _mm256_and_si256(raw1, low4), hi1 = _mm256_and_si256(_mm256_srli_epi16(raw1, 4), low4);
        for (int r = 0; r < R; ++r) {
          int32_t a, c;
          std::memcpy(&a, x + r * k + b * QK + 4 * v, 4);
          std::memcpy(&c, x + r * k + b * QK + 16 + 4 * v, 4);
          const __m256i xa = _mm256_set1_epi32(a), xc = _mm256_set1_epi32(c);
          sums[r][0] = _mm256_add_epi16(sums[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xa),
                                                                     _mm256_maddubs_epi16(hi0, xc)));
          sums[r][1] = _mm256_add_epi16(sums[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xa),
                                                                     _mm256_maddubs_epi16(hi1, xc)));
        }
      }
      const at::Half* d16 = scales + (fb * nb + b) * kX16Features;
      const at::Half* m16 = mins + (fb * nb + b) * kX16Features;
      __m256 d[2], m[2];
      for (int h = 0; h < 2; ++h) {
        d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d16 + 8 * h)));
        m[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m16 + 8 * h)));
      }
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(xd[r * nb + b]), sx = _mm256_set1_ps(xs[r * nb + b]);
        for (int h = 0; h < 2; ++h) {
          const __m256 block_sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r][h], ones));
          acc[r][h] = _mm256_fmadd_ps(block_sums, _mm256_mul_ps(d[h], dx), acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(m[h], sx, acc[r][h]);
        }
      }
    }
  }
  float scale(int64_t, int64_t) const { return 1.f; }
};

// The int8 layers: quantization=int8's (pack_i8x16: w + 128, one float32 scale per channel, applied once at the
// end; kBlockScales false) and GGUF's Q8_0 (pack_q8x16: the same codes, and the file's fp16 scale per block of 32
// values and feature, stored [feature block][K / 32][16] as Q4's; kBlockScales true).
//
// Without VNNI, byte products run on the two vector multiply pipes (vpmaddubsw, vpmaddwd, vpsignb and the float
// FMAs share them: 2 a cycle for any mix on the AVX2 EPYC). A full-range signed weight times a signed code costs
// three of them per 32 products (vpsignb, vpmaddubsw, then vpmaddwd at once, as two such pairs can saturate
// int16). Here x's codes come split in two nibbles, x = 16 hi + lo with hi in [-8, 8] and lo in [-8, 7]
// (split_codes), and the stored u = w + 128 in [0, 255] is vpmaddubsw's unsigned side as it is: a pair of
// products is at most 2 * 255 * 8 = 4080 in size, so a block's 8 steps add up in int16 (<= 32640 < 32767) for
// each nibble. That is two multiplies and two adds per 32 products, and per block
// sum x w = 16 sum u hi + sum u lo - 128 sum x (the last term is quantize_rows' code_sums, as VNNI's).
// The same integers as every other int8 kernel, so the same outputs.
//
// Two rows' step is inline assembly: with intrinsics GCC writes each int16 sum to a fresh register and copies it
// back (8 copies and a spill a step), which made the kernel no faster than three multiplies (the measurement
// is in experiments/results/history_quantization.md).
#define NANOVLLM_NIBBLE_ROW(A, H0, H1, L0, L1)                                                         \
  "vpbroadcastd (%[" A "]), %[t]\n\t"                                                                 \
  "vpmaddubsw %[t], %[u0], %[m]\n\tvpaddw %[m], %[" H0 "], %[" H0 "]\n\t"                             \
  "vpmaddubsw %[t], %[u1], %[m]\n\tvpaddw %[m], %[" H1 "], %[" H1 "]\n\t"                             \
  "vpbroadcastd 32(%[" A "]), %[t]\n\t"                                                               \
  "vpmaddubsw %[t], %[u0], %[m]\n\tvpaddw %[m], %[" L0 "], %[" L0 "]\n\t"                             \
  "vpmaddubsw %[t], %[u1], %[m]\n\tvpaddw %[m], %[" L1 "], %[" L1 "]\n\t"

// One step v (4 values of K, 16 features) of a block: the weights u0, u1 (features 0-7, 8-15) times row a's
// nibbles (a[0..3] high, a[32..35] low) into that row's sums; sums[r] = {hi 0-7, hi 8-15, lo 0-7, lo 8-15}.
inline void nibble_step(__m256i u0, __m256i u1, const int8_t* a, __m256i (&s)[4]) {
  __m256i t, m;
  __asm__(NANOVLLM_NIBBLE_ROW("a", "h0", "h1", "l0", "l1")
          : [h0] "+x"(s[0]), [h1] "+x"(s[1]), [l0] "+x"(s[2]), [l1] "+x"(s[3]), [t] "=&x"(t), [m] "=&x"(m)
          : [u0] "x"(u0), [u1] "x"(u1), [a] "r"(a)
          : "memory");
}
inline void nibble_step(__m256i u0, __m256i u1, const int8_t* a, const int8_t* b, __m256i (&s)[4],
                        __m256i (&z)[4]) {
  __m256i t, m;
  __asm__(NANOVLLM_NIBBLE_ROW("a", "h0", "h1", "l0", "l1") NANOVLLM_NIBBLE_ROW("b", "g0", "g1", "k0", "k1")
          : [h0] "+x"(s[0]), [h1] "+x"(s[1]), [l0] "+x"(s[2]), [l1] "+x"(s[3]), [g0] "+x"(z[0]), [g1] "+x"(z[1]),
            [k0] "+x"(z[2]), [k1] "+x"(z[3]), [t] "=&x"(t), [m] "=&x"(m)
          : [u0] "x"(u0), [u1] "x"(u1), [a] "r"(a), [b] "r"(b)
          : "memory");
}
#undef NANOVLLM_NIBBLE_ROW

template <bool kBlockScales>
struct Int8x16Avx2 {
  const uint8_t* codes;
  const float* channel_scales;  // int8: [16 x feature blocks]
  const at::Half* block_scales;  // Q8_0: [feature blocks][K / 32][16]
  int64_t nb;

  static constexpr int64_t kCodeStride = 2;  // x's rows as split_codes writes them

  // x: R rows of split codes (row stride 2 k: per block, 32 high nibbles then 32 low ones); xc: 128 sum(codes).
  template <int R>
  void dot(int64_t fb, const int8_t* x, int64_t k, const float* xd, const float*, const int32_t* xc,
           __m256 (*acc)[2]) const {
    const __m256i sixteen = _mm256_set1_epi16(16), ones = _mm256_set1_epi16(1);
    const uint8_t* fb_codes = codes + fb * nb * 512;
    for (int64_t b = 0; b < nb; ++b) {
      __m256i sums[R][4];
      for (auto& row : sums)
        for (auto& v : row) v = _mm256_setzero_si256();
      const int8_t* xb = x + b * 2 * QK;
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) {
        const uint8_t* block = fb_codes + b * 512 + 64 * v;
        const __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
        const __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32));
        if constexpr (R == 2) nibble_step(u0, u1, xb + 4 * v, xb + 2 * k + 4 * v, sums[0], sums[1]);
        else nibble_step(u0, u1, xb + 4 * v, sums[0]);
      }
      __m256 dw[2];
      if constexpr (kBlockScales) {
        const at::Half* d16 = block_scales + (fb * nb + b) * kX16Features;
        for (int h = 0; h < 2; ++h)
          dw[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d16 + 8 * h)));
      }
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(xd[r * nb + b]);
        const __m256i correction = _mm256_set1_epi32(xc[r * nb + b]);
        for (int h = 0; h < 2; ++h) {
          const __m256i block_sums = _mm256_sub_epi32(
              _mm256_add_epi32(_mm256_madd_epi16(sums[r][h], sixteen), _mm256_madd_epi16(sums[r][2 + h], ones)),
              correction);
          const __m256 scale = kBlockScales ? _mm256_mul_ps(dw[h], dx) : dx;
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sums), scale, acc[r][h]);
        }
      }
    }
  }
  float scale(int64_t fb, int64_t j) const { return kBlockScales ? 1.f : channel_scales[fb * kX16Features + j]; }
};
using I8x16Avx2 = Int8x16Avx2<false>;
using Q8x16Avx2 = Int8x16Avx2<true>;

// Rows [t0, t1) against feature block fb (two rows a pass), into y. Not inlined into x16_gemm_avx2's loop over
// work items: there GCC gave the kernels' inline-asm steps fewer registers and spilled their sums to the stack
// every step.
template <typename T, typename W>
__attribute__((noinline)) void x16_block_avx2(const W& w, int64_t fb, int64_t t0, int64_t t1, int64_t k, int64_t n,
                                              const T* bias, T* y, const int8_t* xq, const float* xd,
                                              const float* xs, const int32_t* xc) {
  const int64_t nb = k / QK;
  const int64_t col = fb * kX16Features, count = std::min(kX16Features, n - col);
  for (int64_t r0 = t0; r0 < t1; r0 += 2) {
    const int64_t group = std::min<int64_t>(2, t1 - r0);
    __m256 acc[2][2];
    for (auto& row : acc) row[0] = row[1] = _mm256_setzero_ps();
    const int8_t* x = xq + r0 * W::kCodeStride * k;
    const float* s = xs == nullptr ? nullptr : xs + r0 * nb;
    const int32_t* c = xc == nullptr ? nullptr : xc + r0 * nb;
    if (group == 2) w.template dot<2>(fb, x, k, xd + r0 * nb, s, c, acc);
    else w.template dot<1>(fb, x, k, xd + r0 * nb, s, c, acc);
    for (int64_t r = 0; r < group; ++r) {
      alignas(32) float out[kX16Features];
      _mm256_store_ps(out, acc[r][0]);
      _mm256_store_ps(out + 8, acc[r][1]);
      T* dst = y + (r0 + r) * n + col;
      for (int64_t j = 0; j < count; ++j) {
        const float value = out[j] * w.scale(fb, j);
        dst[j] = static_cast<T>(bias != nullptr ? value + to_float(bias[col + j]) : value);
      }
    }
  }
}

// y = x W^T (+ bias) over a layer interleaved by 16 features (Q4x16Avx2, I8x16Avx2 or Q8x16Avx2); xq, xd, xs,
// xc: x's codes (split_codes' for the int8 layers), scales, scaled code sums (Q4) and 128 x code sums (int8).
template <typename T, typename W>
void x16_gemm_avx2(int64_t rows, int64_t k, int64_t n, const W& w, const T* bias, T* y, const int8_t* xq,
                   const float* xd, const float* xs, const int32_t* xc) {
  const int64_t used = (n + kX16Features - 1) / kX16Features;  // feature blocks holding real outputs
  const int64_t tiles = (rows + kX16RowTile - 1) / kX16RowTile;
  TileRanges work(tiles, used);
#pragma omp parallel
  {
    // One feature block at a time from the thread's even share, then from the others' (TileRanges).
    const int64_t me = omp_get_thread_num();
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t t0 = tile * kX16RowTile, t1 = std::min(rows, t0 + kX16RowTile);
      int64_t fb = 0, taken = 0;
      for (int64_t victim = me; work.take(tile, me, 1, victim, fb, taken);)
        x16_block_avx2(w, fb, t0, t1, k, n, bias, y, xq, xd, xs, xc);
    }
  }
}
#endif

}  // namespace

// Whether this build has q4x16_linear (Q4 interleaved by 16 features, pack_q4x16): with VNNI in the
// avx512_bf16 build, with AVX2's byte multiply-adds in the avx2 and avx512 builds.
bool q4x16_available() {
#if defined(NANOVLLM_Q4X16) || defined(NANOVLLM_X16_AVX2)
  return true;
#else
  return false;
#endif
}

// Whether this build has i8x16_linear (int8 interleaved by 16 features, pack_i8x16): VNNI's in the avx512_bf16
// build, AVX2's multiply by split codes in the avx2 and avx512 builds.
bool i8x16_available() {
#if defined(NANOVLLM_Q4X16) || defined(NANOVLLM_X16_AVX2)
  return true;
#else
  return false;
#endif
}

// Whether this build has q8x16_linear (GGUF's Q8_0 interleaved by 16 features, pack_q8x16): the avx2 and avx512
// builds (the avx512_bf16 build's row kernel takes two Q8_0 blocks per 512-bit VNNI instruction instead).
bool q8x16_available() {
#if defined(NANOVLLM_X16_AVX2)
  return true;
#else
  return false;
#endif
}

// Which vector path this build's quantized GEMM runs (the profile prints it beside each linear).
std::string quant_gemm_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512_vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

namespace {

// bias [N] in x's dtype, contiguous (undefined when there is none).
at::Tensor checked_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& x, int64_t n, const char* op) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == n, op, ": bias [N] in x's dtype");
  return bias->contiguous();
}

// run(out, bias) once, with the pointers of x's dtype (float32 or bfloat16): the interleaved kernels' dispatch.
template <typename Run>
void dispatch_x_dtype(const at::Tensor& x, at::Tensor& y, const at::Tensor& bias_c, const char* op, Run&& run) {
  using BF16 = c10::BFloat16;
  switch (x.scalar_type()) {
    case at::kFloat: run(y.data_ptr<float>(), bias_c.defined() ? bias_c.data_ptr<float>() : nullptr); break;
    case at::kBFloat16: run(y.data_ptr<BF16>(), bias_c.defined() ? bias_c.data_ptr<BF16>() : nullptr); break;
    default: TORCH_CHECK(false, op, ": x must be float32 or bfloat16");
  }
}

#if defined(NANOVLLM_Q4X16) || defined(NANOVLLM_X16_AVX2)
// Codes interleaved by 16 features: uint8 [feature blocks (a multiple of 4), nb * block_bytes] covering n outputs.
void check_x16_codes(const at::Tensor& codes, int64_t nb, int64_t block_bytes, int64_t n, const char* op) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2 &&
                  codes.size(1) == nb * block_bytes && codes.size(0) % kX16Blocks == 0 &&
                  n <= codes.size(0) * kX16Features,
              op, ": codes must be uint8 [blocks of 16 features (a multiple of 4), K / 32 * ", block_bytes,
              "] covering N");
}
#endif

// x [rows, K] (contiguous) as the kernels take it: int8 codes per 32 values, their scales d and s = d sum(codes).
// With code_sums, also 128 times each block's sum of codes (int32, i8x16_linear's correction); with split, the
// codes split in nibbles ([rows, 2 K], the AVX2 int8 layers') in place of the plain ones. The tensors are this
// thread's scratch (scratch.h): valid until its next quantize_activations, i.e. for the one layer call.
struct QuantizedRows {
  at::Tensor codes, scales, sums, code_sums, split;
  const int32_t* code_sums_ptr() const { return code_sums.defined() ? code_sums.data_ptr<int32_t>() : nullptr; }
};
QuantizedRows quantize_activations(const at::Tensor& x, bool code_sums = false, bool split = false) {
  const int64_t rows = x.size(0), k = x.size(1), nb = k / QK;
  using nanovllm::Scratch, nanovllm::thread_scratch;
  QuantizedRows q{split ? at::Tensor() : thread_scratch(Scratch::kCodes, {rows, k}, at::kChar),
                  thread_scratch(Scratch::kScales, {rows, nb}, at::kFloat),
                  thread_scratch(Scratch::kSums, {rows, nb}, at::kFloat),
                  code_sums ? thread_scratch(Scratch::kCodeSums, {rows, nb}, at::kInt) : at::Tensor(),
                  split ? thread_scratch(Scratch::kCodes2, {rows, 2 * k}, at::kChar) : at::Tensor()};
  int32_t* sums = code_sums ? q.code_sums.data_ptr<int32_t>() : nullptr;
  int8_t* codes = split ? nullptr : q.codes.data_ptr<int8_t>();
  int8_t* halves = split ? q.split.data_ptr<int8_t>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), rows, k, codes, q.scales.data_ptr<float>(), q.sums.data_ptr<float>(), sums,
                  halves);
  } else {
    quantize_rows(x.data_ptr<c10::BFloat16>(), rows, k, codes, q.scales.data_ptr<float>(), q.sums.data_ptr<float>(),
                  sums, halves);
  }
  return q;
}

}  // namespace

// x [rows, K] float32 or bfloat16; qweight int8 [N, K] (int8, q8_0) or uint8 [N, K / 2] (q4); scales float32
// [N] (int8) or float16 [N, K / 32]; mins float16 [N, K / 32] (q4 only); bias [N] in x's dtype or None.
// Returns [rows, N] in x's dtype.
at::Tensor quant_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales,
                           c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias, int64_t format) {
  TORCH_CHECK(format == kInt8 || format == kQ8_0 || format == kQ4, "quant_linear: unknown format ", format);
  TORCH_CHECK(x.dim() == 2, "quant_linear: x must be [rows, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_linear: x must be float32 or bfloat16");
  x = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = qweight.size(0), nb = k / QK;
  TORCH_CHECK(k % QK == 0, "quant_linear: K (", k, ") must be a multiple of 32");
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous(), "quant_linear: weights must be contiguous");
  if (format == kQ4) {
    TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.size(1) * 2 == k, "quant_linear: q4 codes [N, K/2] uint8");
    TORCH_CHECK(mins.has_value() && mins->scalar_type() == at::kHalf && mins->is_contiguous() &&
                    mins->numel() == n * nb, "quant_linear: q4 needs float16 mins [N, K/32]");
  } else {
    TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.size(1) == k, "quant_linear: int8 codes [N, K]");
  }
  if (format == kInt8) {
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == n, "quant_linear: int8 scales float32 [N]");
  } else {
    TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.numel() == n * nb, "quant_linear: float16 scales [N, K/32]");
  }
  const at::Tensor bias_c = checked_bias(bias, x, n, "quant_linear");
  const QuantizedRows xq = quantize_activations(x);
  auto y = at::empty({rows, n}, x.options());
  const Weights weights{static_cast<QuantFormat>(format), qweight.data_ptr(), scales.data_ptr(),
                        format == kQ4 ? mins->data_ptr<at::Half>() : nullptr};
  AT_DISPATCH_SWITCH(x.scalar_type(), "quant_linear",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        quant_gemm(rows, k, n, weights, bias_c.defined() ? bias_c.data_ptr<float>() : nullptr, y.data_ptr<float>(),
                   xq.codes.data_ptr<int8_t>(), xq.scales.data_ptr<float>(), xq.sums.data_ptr<float>());
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        using T = c10::BFloat16;
        quant_gemm(rows, k, n, weights, bias_c.defined() ? bias_c.data_ptr<T>() : nullptr, y.data_ptr<T>(),
                   xq.codes.data_ptr<int8_t>(), xq.scales.data_ptr<float>(), xq.sums.data_ptr<float>());
      }));
  return y;
}

// x [rows, K] float32 or bfloat16 times Q4 blocks interleaved by 16 features (pack_q4x16 in
// nanovllm/models/quantized.py: codes uint8 [Nb, K / 32 * 256], scales and mins float16 [Nb, K / 32, 16], Nb
// blocks of 16 features, a multiple of 4) for out_features <= 16 Nb outputs (+ bias [N] in x's dtype).
at::Tensor q4x16_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor mins,
                           c10::optional<at::Tensor> bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "q4x16_linear: x must be [rows, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "q4x16_linear: x must be float32 or bfloat16");
#if defined(NANOVLLM_Q4X16) || defined(NANOVLLM_X16_AVX2)
  x = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), nb = k / QK, n = out_features;
  TORCH_CHECK(k % QK == 0, "q4x16_linear: K (", k, ") must be a multiple of 32");
  check_x16_codes(codes, nb, 256, n, "q4x16_linear");
  for (const auto* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == codes.size(0) * nb * kX16Features,
                "q4x16_linear: scales and mins must be float16 [blocks, K / 32, 16]");
  const at::Tensor bias_c = checked_bias(bias, x, n, "q4x16_linear");
  const QuantizedRows xq = quantize_activations(x);
  auto y = at::empty({rows, n}, x.options());
  // One call per dtype; the build picks the kernel (VNNI's x16_gemm, or AVX2's byte multiply-adds).
  auto run = [&](auto* out, const auto* bias_p) {
#if defined(NANOVLLM_X16_AVX2)
    const Q4x16Avx2 weights{codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(), nb};
    x16_gemm_avx2(rows, k, n, weights, bias_p, out, xq.codes.data_ptr<int8_t>(), xq.scales.data_ptr<float>(),
                  xq.sums.data_ptr<float>(), nullptr);
#else
    const Q4x16Weights weights{codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(), nb};
    x16_gemm(rows, k, n, weights, bias_p, out, xq.codes.data_ptr<int8_t>(), xq.scales.data_ptr<float>(),
             xq.sums.data_ptr<float>(), nullptr);
#endif
  };
  dispatch_x_dtype(x, y, bias_c, "q4x16_linear", run);
  return y;
#else
  TORCH_CHECK(false, "q4x16_linear: this kernel build has no AVX2 (the avx2, avx512 and avx512_bf16 builds have it)");
  return x;
#endif
}

// x [rows, K] float32 or bfloat16 times int8 weights interleaved by 16 features (pack_i8x16 in
// nanovllm/models/quantized.py: codes uint8 [Nb, K / 32 * 512] of w + 128, channel scales float32 [16 Nb], Nb
// blocks of 16 features, a multiple of 4) for out_features <= 16 Nb outputs (+ bias [N] in x's dtype).
at::Tensor i8x16_linear(at::Tensor x, at::Tensor codes, at::Tensor scales,
                           c10::optional<at::Tensor> bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "i8x16_linear: x must be [rows, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "i8x16_linear: x must be float32 or bfloat16");
#if defined(NANOVLLM_Q4X16) || defined(NANOVLLM_X16_AVX2)
  x = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), nb = k / QK, n = out_features;
  TORCH_CHECK(k % QK == 0, "i8x16_linear: K (", k, ") must be a multiple of 32");
  check_x16_codes(codes, nb, 512, n, "i8x16_linear");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == codes.size(0) * kX16Features,
              "i8x16_linear: scales must be float32 [16 x blocks]");
  const at::Tensor bias_c = checked_bias(bias, x, n, "i8x16_linear");
  auto y = at::empty({rows, n}, x.options());
  // One call per dtype; the build picks the kernel (VNNI's x16_gemm, or AVX2's multiply by split codes).
  auto run = [&](auto* out, const auto* bias_p) {
#if defined(NANOVLLM_X16_AVX2)
    const QuantizedRows xq = quantize_activations(x, /*code_sums=*/true, /*split=*/true);
    const I8x16Avx2 weights{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), nullptr, nb};
    x16_gemm_avx2(rows, k, n, weights, bias_p, out, xq.split.data_ptr<int8_t>(), xq.scales.data_ptr<float>(),
                  nullptr, xq.code_sums_ptr());
#else
    const QuantizedRows xq = quantize_activations(x, /*code_sums=*/true);  // VNNI's correction for w + 128
    const I8x16Weights weights{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), nb};
    x16_gemm(rows, k, n, weights, bias_p, out, xq.codes.data_ptr<int8_t>(), xq.scales.data_ptr<float>(),
             xq.sums.data_ptr<float>(), xq.code_sums_ptr());
#endif
  };
  dispatch_x_dtype(x, y, bias_c, "i8x16_linear", run);
  return y;
#else
  TORCH_CHECK(false, "i8x16_linear: this kernel build has no AVX2 (the avx2, avx512 and avx512_bf16 builds have it)");
  return x;
#endif
}

// x [rows, K] float32 or bfloat16 times GGUF Q8_0 blocks interleaved by 16 features (pack_q8x16 in
// nanovllm/models/quantized.py: codes uint8 [Nb, K / 32 * 512] of w + 128 as pack_i8x16's, scales float16
// [Nb, K / 32, 16], Nb blocks of 16 features, a multiple of 4) for out_features <= 16 Nb outputs (+ bias [N] in
// x's dtype).
at::Tensor q8x16_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> bias,
                        int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "q8x16_linear: x must be [rows, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "q8x16_linear: x must be float32 or bfloat16");
#if defined(NANOVLLM_X16_AVX2)
  x = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), nb = k / QK, n = out_features;
  TORCH_CHECK(k % QK == 0, "q8x16_linear: K (", k, ") must be a multiple of 32");
  check_x16_codes(codes, nb, 512, n, "q8x16_linear");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == codes.size(0) * nb * kX16Features,
              "q8x16_linear: scales must be float16 [blocks, K / 32, 16]");
  const at::Tensor bias_c = checked_bias(bias, x, n, "q8x16_linear");
  const QuantizedRows xq = quantize_activations(x, /*code_sums=*/true, /*split=*/true);
  auto y = at::empty({rows, n}, x.options());
  const Q8x16Avx2 weights{codes.data_ptr<uint8_t>(), nullptr, scales.data_ptr<at::Half>(), nb};
  auto run = [&](auto* out, const auto* bias_p) {
    x16_gemm_avx2(rows, k, n, weights, bias_p, out, xq.split.data_ptr<int8_t>(), xq.scales.data_ptr<float>(),
                  nullptr, xq.code_sums_ptr());
  };
  dispatch_x_dtype(x, y, bias_c, "q8x16_linear", run);
  return y;
#else
  TORCH_CHECK(false, "q8x16_linear: this kernel build has no AVX2 interleaved kernels (the avx2 and avx512 builds have them)");
  return x;
#endif
}

// A torch operator too (torch.ops.<build namespace>.quant_linear), so profiles count it as a linear layer.
#ifndef NANOVLLM_OPS
#define NANOVLLM_OPS nanovllm
#endif
TORCH_LIBRARY_FRAGMENT(NANOVLLM_OPS, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, int format) -> Tensor");
  m.def("q4x16_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias, int out_features) -> Tensor");
  m.def("i8x16_linear(Tensor x, Tensor codes, Tensor scales, Tensor? bias, int out_features) -> Tensor");
  m.def("q8x16_linear(Tensor x, Tensor codes, Tensor scales, Tensor? bias, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(NANOVLLM_OPS, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("q4x16_linear", &q4x16_linear);
  m.impl("i8x16_linear", &i8x16_linear);
  m.impl("q8x16_linear", &q8x16_linear);
}
