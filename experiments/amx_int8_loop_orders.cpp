// The AMX-INT8 GEMM's two loop orders side by side, on one thread, at a decode step's 32 rows and the default
// model's projection shapes (30 layers' distinct weights, the LM head once), in one process with the orders
// taking turns and the fastest of 60 rounds kept (the machine's slow spells only ever add time).
//
//   before: one row tile of 16 rows against a pair of 16-feature blocks, both digits in the same K loop
//           (x digit 1, x digit 2, two weight tiles: four loads for four products with two digits, three loads
//           for two products with one);
//   after:  two row tiles x two blocks per digit (nanovllm/csrc/int8_amx.cpp's multiply_digit): four loads for
//           four products either way, digit 1's sums parked in memory while digit 2 takes the tiles.
// Both run the kernel's float epilogue. Build and run (an AMX-INT8 CPU; Linux grants the tiles on request):
//
//   g++ -O3 -march=sapphirerapids experiments/amx_int8_loop_orders.cpp -o /tmp/amx_int8_loop_orders
//   taskset -c 1 /tmp/amx_int8_loop_orders
//
// It checks that both orders give the same outputs (integer sums are exact in any order).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
constexpr int64_t kFeatures = 16, kTileK = 64, kRows = 32;

void configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  asm volatile("" : : "r"(&c) : "memory");  // keep the stores: ldtilecfg reads them
  _tile_loadconfig(&c);
}

// The kernel's epilogue for 16 rows of one block: y = d (c1 - 128 s1 + (c2 - 128 s2) / 256) * scale, as bf16.
template <bool kTwo>
void finish(const int32_t* c1, const int32_t* c2, const float* d, const int32_t* sums, const float* scales,
            uint16_t* y, int64_t ldy) {
  for (int r = 0; r < 16; ++r) {
    __m512 s = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(c1 + r * 16), _mm512_set1_epi32(128 * sums[2 * r])));
    if (kTwo)
      s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(c2 + r * 16),
                                                               _mm512_set1_epi32(128 * sums[2 * r + 1]))),
                          _mm512_set1_ps(1.f / 256), s);
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(d[r]), s), _mm512_loadu_ps(scales));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
}

template <bool kTwo>
void before(int64_t kp, int64_t n, const int8_t* p1, const int8_t* p2, const uint8_t* w, const float* d,
            const int32_t* sums, const float* scales, uint16_t* y) {
  configure();
  alignas(64) int32_t c1[256], c2[256];
  for (int64_t pair = 0; pair < n / kFeatures / 2; ++pair) {
    const uint8_t* wa = w + 2 * pair * kp * kFeatures;
    const uint8_t* wb = wa + kp * kFeatures;
    for (int64_t mt = 0; mt < kRows / 16; ++mt) {
      const int8_t* x1 = p1 + mt * 16 * kp;
      const int8_t* x2 = p2 + mt * 16 * kp;
      _tile_zero(0);
      _tile_zero(5);
      if (kTwo) {
        _tile_zero(3);
        _tile_zero(6);
      }
      for (int64_t kk = 0; kk < kp; kk += kTileK) {
        _tile_loadd(1, x1 + kk, kp);
        if (kTwo) _tile_loadd(4, x2 + kk, kp);
        _tile_loadd(2, wa + kk * kFeatures, 64);
        _tile_loadd(7, wb + kk * kFeatures, 64);
        _tile_dpbsud(0, 1, 2);
        if (kTwo) _tile_dpbsud(3, 4, 2);
        _tile_dpbsud(5, 1, 7);
        if (kTwo) _tile_dpbsud(6, 4, 7);
      }
      uint16_t* out = y + mt * 16 * n + 2 * pair * kFeatures;
      _tile_stored(0, c1, 64);
      if (kTwo) _tile_stored(3, c2, 64);
      finish<kTwo>(c1, c2, d + mt * 16, sums + 32 * mt, scales + 2 * pair * kFeatures, out, n);
      _tile_stored(5, c1, 64);
      if (kTwo) _tile_stored(6, c2, 64);
      finish<kTwo>(c1, c2, d + mt * 16, sums + 32 * mt, scales + 2 * pair * kFeatures + 16, out + 16, n);
    }
  }
  _tile_release();
}

template <bool kTwo>
void after(int64_t kp, int64_t n, const int8_t* p1, const int8_t* p2, const uint8_t* w, const float* d,
           const int32_t* sums, const float* scales, uint16_t* y) {
  configure();
  alignas(64) int32_t first[4][256], second[256];
  for (int64_t pair = 0; pair < n / kFeatures / 2; ++pair) {
    const uint8_t* wa = w + 2 * pair * kp * kFeatures;
    const uint8_t* wb = wa + kp * kFeatures;
    for (int digit = 0; digit < (kTwo ? 2 : 1); ++digit) {
      const int8_t* xa = digit == 0 ? p1 : p2;
      const int8_t* xb = xa + 16 * kp;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kk = 0; kk < kp; kk += kTileK) {
        _tile_loadd(4, xa + kk, kp);
        _tile_loadd(6, wa + kk * kFeatures, 64);
        _tile_dpbsud(0, 4, 6);
        _tile_loadd(5, xb + kk, kp);
        _tile_dpbsud(1, 5, 6);
        _tile_loadd(7, wb + kk * kFeatures, 64);
        _tile_dpbsud(2, 4, 7);
        _tile_dpbsud(3, 5, 7);
      }
      if (kTwo && digit == 0) {
        _tile_stored(0, first[0], 64);
        _tile_stored(1, first[1], 64);
        _tile_stored(2, first[2], 64);
        _tile_stored(3, first[3], 64);
      }
    }
    uint16_t* out = y + 2 * pair * kFeatures;
    const float* sc = scales + 2 * pair * kFeatures;
    _tile_stored(0, kTwo ? second : first[0], 64);
    finish<kTwo>(first[0], second, d, sums, sc, out, n);
    _tile_stored(1, kTwo ? second : first[1], 64);
    finish<kTwo>(first[1], second, d + 16, sums + 32, sc, out + 16 * n, n);
    _tile_stored(2, kTwo ? second : first[2], 64);
    finish<kTwo>(first[2], second, d, sums, sc + 16, out + 16, n);
    _tile_stored(3, kTwo ? second : first[3], 64);
    finish<kTwo>(first[3], second, d + 16, sums + 32, sc + 16, out + 16 * n + 16, n);
  }
  _tile_release();
}

}  // namespace

int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::printf("this CPU or kernel grants no AMX tile state\n");
    return 1;
  }
  struct Shape {
    const char* name;
    int64_t n, k, copies;
    int digits;  // the model's (INT8_ACTIVATION_DIGITS; the LM head two)
  } shapes[] = {{"qkv_proj", 960, 576, 30, 2}, {"o_proj", 576, 576, 30, 1}, {"gate_up_proj", 3072, 576, 30, 1},
                {"down_proj", 576, 1536, 30, 2}, {"lm_head", 49152, 576, 1, 2}};
  using Fn = void (*)(int64_t, int64_t, const int8_t*, const int8_t*, const uint8_t*, const float*, const int32_t*,
                      const float*, uint16_t*);
  double step[2] = {0, 0};
  std::printf("| linear | digits | before us | after us | after / before |\n|---|---|---|---|---|\n");
  for (const Shape& s : shapes) {
    const int64_t kp = (s.k + 63) / 64 * 64;
    std::vector<std::vector<uint8_t>> weights(s.copies, std::vector<uint8_t>(s.n * kp));
    for (auto& w : weights)
      for (auto& v : w) v = static_cast<uint8_t>(std::rand() & 255);
    std::vector<int8_t> p1(kRows * kp), p2(kRows * kp);
    for (auto& v : p1) v = static_cast<int8_t>(std::rand() % 255 - 127);
    for (auto& v : p2) v = static_cast<int8_t>(std::rand() % 255 - 127);
    std::vector<float> d(kRows, 0.01f), scales(s.n, 0.02f);
    std::vector<int32_t> sums(2 * kRows, 3);
    std::vector<uint16_t> y0(kRows * s.n), y1(kRows * s.n);
    const Fn fns[2] = {s.digits == 2 ? before<true> : before<false>, s.digits == 2 ? after<true> : after<false>};
    std::vector<uint16_t>* outs[2] = {&y0, &y1};
    double best[2] = {1e30, 1e30};
    for (int round = 0; round < 60; ++round)
      for (int v = 0; v < 2; ++v) {
        const auto start = std::chrono::steady_clock::now();
        for (auto& w : weights)
          fns[v](kp, s.n, p1.data(), p2.data(), w.data(), d.data(), sums.data(), scales.data(), outs[v]->data());
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
        best[v] = std::min(best[v], us / s.copies);
      }
    if (y0 != y1) {
      std::printf("error: the two loop orders disagree on %s\n", s.name);
      return 1;
    }
    const double layers = s.copies;  // 30 layers, or the LM head once
    step[0] += best[0] * layers;
    step[1] += best[1] * layers;
    std::printf("| %s | %d | %.1f | %.1f | %.2f |\n", s.name, s.digits, best[0], best[1], best[1] / best[0]);
  }
  std::printf("| a decode step's linears (30 layers + LM head) | | %.0f | %.0f | %.2f |\n", step[0], step[1],
              step[1] / step[0]);
  return 0;
}
