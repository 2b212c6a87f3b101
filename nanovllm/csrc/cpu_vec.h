// Small helpers shared by the CPU kernels: float32 views of the storage dtypes, scalar, AVX2 and AVX-512.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace nanovllm {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  // The bit pattern of a bfloat16 is the upper half of the float32: shift, don't call a conversion routine,
  // so the compiler vectorizes loops over it.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// exp's argument reduction and polynomial, shared by exp16 and exp8: x = n ln2 + r, with ln2 split in two
// (kLn2High has few enough bits that n * kLn2High is exact) so r is exact, and exp(r) by its degree-7 Taylor
// polynomial, evaluated by Horner's rule from the highest coefficient.
constexpr float kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr int kExpTerms = 8;
constexpr float kExpTaylor[kExpTerms] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

#if defined(__AVX512F__)
// 16 consecutive values as float32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// 16 float32 lanes rounded to the storage dtype and back (round to nearest even, as c10's conversion does), and
// stored in it.
inline __m512 round16(__m512 v, float*) { return v; }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
#if defined(__AVX512BF16__)
inline __m512 round16(__m512 v, c10::BFloat16*) {
  const __m256i raw = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#endif
// exp(x) for x <= 88 (beyond, +inf): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-7 Taylor
// polynomial (relative error below 2e-7), times 2^n with scalef (0 for x below -104).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < kExpTerms; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[i]));
  return _mm512_scalef_ps(p, n);
}
// Lane i of the result is the sum of the 16 lanes of v[i].
// (The tree's shuffles move 32-bit lanes whatever they hold; `add` adds them as floats or as integers.)
template <typename Add>
inline __m512 sum_each16_with(const __m512* v, Add add) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // lanes of each 128-bit quarter: pairwise sums of v[2i] and v[2i+1], interleaved
    w[i] = add(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // each 128-bit quarter: one partial sum of each of v[4j .. 4j+3]
    const __m512d a = _mm512_castps_pd(w[2 * j]), b = _mm512_castps_pd(w[2 * j + 1]);
    x[j] = add(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  constexpr int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 y0 = add(_mm512_shuffle_f32x4(x[0], x[1], even), _mm512_shuffle_f32x4(x[0], x[1], odd));
  const __m512 y1 = add(_mm512_shuffle_f32x4(x[2], x[3], even), _mm512_shuffle_f32x4(x[2], x[3], odd));
  return add(_mm512_shuffle_f32x4(y0, y1, even), _mm512_shuffle_f32x4(y0, y1, odd));
}
inline __m512 sum_each16(const __m512* v) {
  return sum_each16_with(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}
// The same for int32 lanes: lane i of the result is the sum of v[i]'s 16 lanes, exactly.
inline __m512i sum_each16(const __m512i* v) {
  return _mm512_castps_si512(sum_each16_with(reinterpret_cast<const __m512*>(v), [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }));
}
#endif

#if defined(__AVX2__)
// Fetches the cache line holding p into L2 (prefetcht1). Written as volatile asm because GCC treats
// _mm_prefetch as having no effect that must be kept and, at -O2 and above, deleted whole loops that only
// prefetched (-ffinite-loops: the attention kernels' row prefetches vanished from the binary).
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

// 8 consecutive values as float32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
// exp(x) as exp16 computes it, 8 lanes: the same reduction and polynomial; 2^n is built in the exponent bits, so
// x is clamped to -87 (2^n stays a normal float), where exp16 goes to -104: the result there is ~1e-38 instead of
// smaller, which no softmax numerator (exp(s - max) against the max's 1) can tell apart.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < kExpTerms; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
// Lane i of the result is the sum of the 8 lanes of v[i].
inline __m256 sum_each8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 x = _mm256_hadd_ps(a, b), y = _mm256_hadd_ps(c, d);  // per 128-bit half: v0..v3 | v4..v7 partials
  return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}
// Lane i of the result is the max of the 8 lanes of v[i] (sum_each8 with max for add: a shuffle pair stands
// in for hadd). The max is exact, so this equals hmax8 of each v[i].
inline __m256 max_pairs(__m256 a, __m256 b) {
  return _mm256_max_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline __m256 max_each8(const __m256* v) {
  const __m256 x = max_pairs(max_pairs(v[0], v[1]), max_pairs(v[2], v[3]));
  const __m256 y = max_pairs(max_pairs(v[4], v[5]), max_pairs(v[6], v[7]));
  return _mm256_max_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}
// Lane i of the result is the sum of the 8 int32 lanes of v[i].
inline __m256i sum_each8i(const __m256i* v) {
  const __m256i x = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i y = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(x, y, 0x20), _mm256_permute2x128_si256(x, y, 0x31));
}
#endif

}  // namespace nanovllm
