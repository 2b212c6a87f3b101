// Small helpers shared by the CPU kernels: float32 views of the storage dtypes, scalar and AVX-512.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
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
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 split in two for an exact r
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
// Lane i of the result is the sum of the 16 lanes of v[i].
inline __m512 sum_each16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // lanes of each 128-bit quarter: pairwise sums of v[2i] and v[2i+1], interleaved
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // each 128-bit quarter: one partial sum of each of v[4j .. 4j+3]
    const __m512d a = _mm512_castps_pd(w[2 * j]), b = _mm512_castps_pd(w[2 * j + 1]);
    x[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  constexpr int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], even), _mm512_shuffle_f32x4(x[0], x[1], odd));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], even), _mm512_shuffle_f32x4(x[2], x[3], odd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, even), _mm512_shuffle_f32x4(y0, y1, odd));
}
#endif

}  // namespace nanovllm
