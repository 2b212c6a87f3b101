// The int8 (W8A8) linear on AMX-INT8 tiles: y = x W^T (+ b), W int8 per output channel (vLLM's int8 weights).
//
// Activations: dynamic per-token scales, in one or two int8 digits (the layer chooses, `digits`). Each row x is
// split as x ~ d (p1 + p2 / 256), with d = max|x| / 127, p1 = round(x / d) and p2 = round(256 (x / d - p1))
// (-128 <= p2 <= 128, 128 clamped to 127): a resolution of max|x| / 32512 per token, where one digit (p1 alone,
// vLLM's dynamic per-token scheme) gives max|x| / 127. One digit is too coarse for some projections' inputs;
// the model chooses per projection (models/quantized.py, INT8_ACTIVATION_DIGITS; docs/quantization.md has what
// each choice costs). Groups
// of 32 values with their own scale (the vector kernels, quant_gemm.cpp) would need a float epilogue per 32
// products, which on tiles costs more than the tiles' multiply-adds (a tile's int32 sums go through memory to
// the vector units each time). With one scale per token, the tiles accumulate over all of K, each digit against
// the same weight tile: one or two tile dot products per 64 values of K (AMX-BF16 takes two, at 32 a tile),
// over half the weight bytes; the float epilogue runs once per output.
//
// Weights are stored once, at load, in the layout a tile reads (pack_int8_amx): blocks of 16 output features,
// each [K' / 4][16][4] bytes (four consecutive K values of one feature side by side; K' = K rounded up to 64), as
// unsigned bytes w + 128: AMX multiplies signed x codes by unsigned weight bytes (tdpbsud), and the + 128 costs
// one subtraction per row and digit at the end: sum(p (w + 128)) = sum(p w) + 128 sum(p).
//
// Built into the avx512_bf16 build only (the AMX functions are compiled for AMX by a target pragma; every AMX
// CPU has AVX-512 BF16); int8_amx_available() says whether this CPU and the OS run them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu_vec.h"
#include "scratch.h"


#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__linux__) && defined(__x86_64__)
#define NANOVLLM_AMX_INT8 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kFeatures = 16;  // output features per weight block: a 64-byte tile row of 16 x 4 bytes
constexpr int64_t kTileRows = 16;  // rows of x per tile
constexpr int64_t kTileK = 64;     // K values per tile dot product (64 bytes a row of x's tile)
constexpr float kDigit = 256.f;    // the second digit's weight: p2 counts 1/256ths of the first's step

inline int64_t padded_k(int64_t k) { return (k + kTileK - 1) / kTileK * kTileK; }

// How far ahead of its tile loads amx_gemm asks for weight bytes, into L2. Tile registers are not renamed, so a
// weight tile load that misses L2 stalls the tile products behind it; asking 16 KB ahead (a few K steps, about a
// pair of feature blocks, small beside any AMX CPU's L2) keeps the loads in L2 (`experiments/bench_linears.py`
// measures it). Prefetches never fault, so the last ones may point past the weights.
constexpr int64_t kPrefetchAhead = 16 * 1024;

#if defined(NANOVLLM_AMX_INT8)
// CPUID says AMX-TILE and AMX-INT8, and Linux grants this process the tiles' 8 KB of register state (it does
// so only on request, once per process; torch's oneDNN asks the same way).
bool amx_int8_usable() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!((edx >> 24) & 1u) || !((edx >> 25) & 1u)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// The tile configuration's memory form (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void store_out(float v, float* out) { *out = v; }
inline void store_out(float v, c10::BFloat16* out) { *out = c10::BFloat16(v); }
inline float load_one(float v) { return v; }
inline float load_one(c10::BFloat16 v) { return nanovllm::to_float(v); }
inline __m512 load_row(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_row(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline void store_row(__m512 v, float* out) { _mm512_storeu_ps(out, v); }
// Rounded to nearest even, as torch's float -> bfloat16.
inline void store_row(__m512 v, c10::BFloat16* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// One row of x (K values) -> its digits p1 and, with two digits, p2 (kp codes each, zero past K), the step d
// and the digits' sums (for the unsigned weights' + 128; the second 0 with one digit).
template <bool kTwoDigits, typename T>
void quantize_digits(const T* x, int64_t k, int64_t kp, int8_t* p1, int8_t* p2, float* d, int32_t* sums) {
  // 16 values a step (AVX-512: every AMX CPU has it), the tail of K below 16 one by one.
  const int64_t k16 = k / 16 * 16;
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t i = 0; i < k16; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(nanovllm::load16(x + i)));
  float amax = _mm512_reduce_max_ps(vmax);
  for (int64_t i = k16; i < k; ++i) amax = std::max(amax, std::fabs(load_one(x[i])));
  const float step = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  // p1 = round(x / d) and p2 = round(256 x / d) - 256 p1 (= round(256 (x / d - p1)): both products are exact
  // in float, so this is the second digit's definition), in integers, half to even.
  const __m512 vinv = _mm512_set1_ps(inv), vinv_digit = _mm512_set1_ps(inv * kDigit);
  const __m512i top = _mm512_set1_epi32(127);
  __m512i s1 = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();
  for (int64_t i = 0; i < k16; i += 16) {
    const __m512 v = nanovllm::load16(x + i);
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v, vinv));
    const __m512i q2 = _mm512_min_epi32(top, _mm512_sub_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, vinv_digit)),
                                                              _mm512_slli_epi32(q1, 8)));
    s1 = _mm512_add_epi32(s1, q1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p1 + i), _mm512_cvtsepi32_epi8(q1));
    if constexpr (kTwoDigits) {
      s2 = _mm512_add_epi32(s2, q2);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p2 + i), _mm512_cvtsepi32_epi8(q2));
    }
  }
  int32_t sum1 = _mm512_reduce_add_epi32(s1), sum2 = _mm512_reduce_add_epi32(s2);
  for (int64_t i = k16; i < k; ++i) {
    const float first = std::nearbyint(load_one(x[i]) * inv);
    const float second = std::min(127.f, std::nearbyint(load_one(x[i]) * (inv * kDigit)) - kDigit * first);
    p1[i] = static_cast<int8_t>(first);
    sum1 += static_cast<int32_t>(first);
    if constexpr (kTwoDigits) {
      p2[i] = static_cast<int8_t>(second);
      sum2 += static_cast<int32_t>(second);
    }
  }
  std::fill(p1 + k, p1 + kp, 0);
  if constexpr (kTwoDigits) std::fill(p2 + k, p2 + kp, 0);
  *d = step;
  sums[0] = sum1;
  sums[1] = sum2;
}

// The weight tile at w (kTileK / 4 rows of 64 bytes) kPrefetchAhead further on, into L2.
inline void prefetch_weight_tile(const uint8_t* w) {
  const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchAhead;
  for (int64_t line = 0; line < kTileK * kFeatures; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8")

// Tiles: 0-3 the int32 sums of one digit for (row tile a, block a), (row tile b, block a), (row tile a, block b),
// (row tile b, block b); 4/5 the digit's codes of row tiles a/b; 6/7 the weights of blocks a/b.
inline void configure_tiles(int64_t tile_rows) {
  TileConfig config;
  for (int t : {0, 1, 2, 3, 4, 5}) {
    config.rows[t] = static_cast<uint8_t>(tile_rows);
    config.colsb[t] = 64;
  }
  for (int t : {6, 7}) {
    config.rows[t] = kTileK / 4;
    config.colsb[t] = 64;
  }
  // GCC does not treat ldtilecfg as reading the configuration's memory and may drop the stores above as dead (it
  // did once they were contiguous); the empty asm says that memory is read.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// One block of 16 features for `rows` rows from the int32 sums of the digits: y = s_w d (c1 + c2 / 256) + b,
// c the sums less the unsigned weights' 128 x the digits' sums (c2 = 0 with one digit; c2 is not read then).
template <bool kTwoDigits, typename T>
inline void finish_block(const int32_t* c1, const int32_t* c2, int64_t rows, const float* d, const int32_t* digit_sums,
                         const float* scales, const T* bias, int64_t cols, T* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512i first = _mm512_sub_epi32(_mm512_load_si512(c1 + r * kFeatures), _mm512_set1_epi32(128 * digit_sums[2 * r]));
    __m512 sum = _mm512_cvtepi32_ps(first);
    if constexpr (kTwoDigits) {
      const __m512i second = _mm512_sub_epi32(_mm512_load_si512(c2 + r * kFeatures),
                                              _mm512_set1_epi32(128 * digit_sums[2 * r + 1]));
      sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(second), _mm512_set1_ps(1.f / kDigit), sum);
    }
    const __m512 v = _mm512_mul_ps(_mm512_set1_ps(d[r]), sum);
    if (cols == kFeatures) {
      const __m512 b = bias != nullptr ? load_row(bias) : _mm512_setzero_ps();
      store_row(_mm512_fmadd_ps(v, _mm512_loadu_ps(scales), b), y + r * ldy);
    } else {  // the last block of an N that is not a multiple of 16
      alignas(64) float out[kFeatures];
      _mm512_store_ps(out, v);
      for (int64_t j = 0; j < cols; ++j)
        store_out(scales[j] * out[j] + (bias != nullptr ? load_one(bias[j]) : 0.f), y + r * ldy + j);
    }
  }
}

// One digit's products over all of K for up to two row tiles (xa, xb: that digit's codes, rows kp apart) and up
// to two blocks of 16 features (wa, wb) into tiles 0-3 (the layout above). Two by two, each tile load feeds two
// tile products: on a tile unit that runs loads and products one after the other, loads are a third of its time
// at one load a product, against two fifths when one row tile's codes meet two blocks alone. `prefetch`: the
// weights' first pass (later row tiles and digits find them in cache).
template <bool kTwoRowTiles, bool kTwoBlocks>
inline void multiply_digit(const int8_t* xa, const int8_t* xb, const uint8_t* wa, const uint8_t* wb, int64_t kp,
                           bool prefetch) {
  _tile_zero(0);
  if constexpr (kTwoRowTiles) _tile_zero(1);
  if constexpr (kTwoBlocks) _tile_zero(2);
  if constexpr (kTwoRowTiles && kTwoBlocks) _tile_zero(3);
  for (int64_t kk = 0; kk < kp; kk += kTileK) {
    if (prefetch) {
      prefetch_weight_tile(wa + kk * kFeatures);
      if constexpr (kTwoBlocks) prefetch_weight_tile(wb + kk * kFeatures);
    }
    _tile_loadd(4, xa + kk, kp);
    _tile_loadd(6, wa + kk * kFeatures, 64);
    _tile_dpbsud(0, 4, 6);
    if constexpr (kTwoRowTiles) {
      _tile_loadd(5, xb + kk, kp);
      _tile_dpbsud(1, 5, 6);
    }
    if constexpr (kTwoBlocks) {
      _tile_loadd(7, wb + kk * kFeatures, 64);
      _tile_dpbsud(2, 4, 7);
      if constexpr (kTwoRowTiles) _tile_dpbsud(3, 5, 7);
    }
  }
}

// Tile t's 16 x 16 int32 sums into c (tile numbers are immediates).
inline void store_sums(int t, int32_t* c) {
  switch (t) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
  }
}

// Up to two row tiles (from row0, `rows` rows in all) times up to two blocks (from block nb): the digits' products
// (digit 1's sums parked in memory while digit 2 takes the tiles), then each (row tile, block)'s epilogue.
template <bool kTwoDigits, bool kTwoRowTiles, bool kTwoBlocks, typename T>
void multiply_tiles(int64_t row0, int64_t rows, int64_t nb, int64_t n, int64_t kp, const int8_t* p1, const int8_t* p2,
                    const float* d, const int32_t* digit_sums, const uint8_t* packed, const float* scales,
                    const T* bias, T* y, bool prefetch) {
  const uint8_t* wa = packed + nb * kp * kFeatures;
  const uint8_t* wb = wa + kp * kFeatures;
  alignas(64) int32_t first[4][kTileRows * kFeatures], second[kTileRows * kFeatures];
  // The second row tile's codes sit kTileRows rows on (only read with two row tiles).
  const int64_t next = kTwoRowTiles ? kTileRows * kp : 0;
  multiply_digit<kTwoRowTiles, kTwoBlocks>(p1 + row0 * kp, p1 + row0 * kp + next, wa, wb, kp, prefetch);
  if constexpr (kTwoDigits) {
    for (int t = 0; t < 4; ++t)
      if ((kTwoRowTiles || t % 2 == 0) && (kTwoBlocks || t < 2)) store_sums(t, first[t]);
    multiply_digit<kTwoRowTiles, kTwoBlocks>(p2 + row0 * kp, p2 + row0 * kp + next, wa, wb, kp, false);
  }
  for (int t = 0; t < 4; ++t) {
    const int64_t row_tile = t % 2, block = t / 2;
    if ((!kTwoRowTiles && row_tile == 1) || (!kTwoBlocks && block == 1)) continue;
    store_sums(t, kTwoDigits ? second : first[t]);
    const int64_t r0 = row0 + row_tile * kTileRows, tile_rows = std::min(kTileRows, rows - row_tile * kTileRows);
    const int64_t col0 = (nb + block) * kFeatures, cols = std::min(kFeatures, n - col0);
    finish_block<kTwoDigits>(first[t], second, tile_rows, d + r0, digit_sums + 2 * r0, scales + col0,
                             bias != nullptr ? bias + col0 : nullptr, cols, y + r0 * n + col0, n);
  }
}

// y [m, n] = x [m, k] times the packed weights and the channel scales: each row of x quantized into the digits p1
// (and p2 with two digits) [m_pad, kp] (m_pad: m rounded up to whole tiles from 16 rows on, the rows past m
// already zero), its step d [m] and digit sums [m, 2], then the tiles' products. Both in one parallel region: a
// decode step calls this some 120 times on a few rows each, and a second fork and join per call cost about as
// much as quantizing.
template <bool kTwoDigits, typename T>
void amx_gemm(int64_t m, int64_t k, int64_t kp, int64_t n, const T* x, int8_t* p1, int8_t* p2, float* d,
              int32_t* digit_sums, const uint8_t* packed, const float* scales, const T* bias, T* y) {
  const int64_t n_blocks = (n + kFeatures - 1) / kFeatures, pairs = (n_blocks + 1) / 2;
  const int64_t tile_rows = std::min<int64_t>(m, kTileRows);  // below 16 rows, tiles of exactly m rows
  const int64_t m_tiles = (m + kTileRows - 1) / kTileRows;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r)
      quantize_digits<kTwoDigits>(x + r * k, k, kp, p1 + r * kp, kTwoDigits ? p2 + r * kp : nullptr, d + r,
                                  digit_sums + 2 * r);
    // (the loop's barrier: every row's digits are in place before any tile reads them)
    configure_tiles(tile_rows);
    // Pairs of feature blocks, then pairs of row tiles: a pair's weights (2 x K' x 16 bytes) stay in L1/L2 while
    // every row tile passes.
#pragma omp for schedule(static)
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int64_t nb = 2 * pair;
      const bool two_blocks = nb + 1 < n_blocks;
      for (int64_t mt = 0; mt < m_tiles; mt += 2) {
        const int64_t row0 = mt * kTileRows, rows = std::min(2 * kTileRows, m - row0);
        const bool two_row_tiles = mt + 1 < m_tiles, prefetch = mt == 0;
        const auto run = [&](auto two_rows, auto two_cols) {
          multiply_tiles<kTwoDigits, decltype(two_rows)::value, decltype(two_cols)::value>(
              row0, rows, nb, n, kp, p1, p2, d, digit_sums, packed, scales, bias, y, prefetch);
        };
        using Yes = std::true_type;
        using No = std::false_type;
        if (two_row_tiles) {
          if (two_blocks) run(Yes{}, Yes{}); else run(Yes{}, No{});
        } else {
          if (two_blocks) run(No{}, Yes{}); else run(No{}, No{});
        }
      }
    }
    _tile_release();
  }
}

#pragma GCC pop_options
#endif

#if defined(NANOVLLM_AMX_INT8)
template <bool kTwoDigits, typename T>
void quantize_and_multiply(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& bias, at::Tensor& p1, at::Tensor& p2, at::Tensor& d,
                           at::Tensor& digit_sums, at::Tensor& y) {
  const int64_t rows = x.size(0), k = x.size(1), kp = p1.size(1), n = y.size(1);
  amx_gemm<kTwoDigits>(rows, k, kp, n, x.data_ptr<T>(), p1.data_ptr<int8_t>(),
                       kTwoDigits ? p2.data_ptr<int8_t>() : nullptr, d.data_ptr<float>(),
                       digit_sums.data_ptr<int32_t>(), packed.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                       bias.defined() ? bias.data_ptr<T>() : nullptr, y.data_ptr<T>());
}

template <typename T>
void quantize_and_multiply(int64_t digits, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& bias, at::Tensor& p1, at::Tensor& p2, at::Tensor& d,
                           at::Tensor& digit_sums, at::Tensor& y) {
  if (digits == 2) {
    quantize_and_multiply<true, T>(x, packed, scales, bias, p1, p2, d, digit_sums, y);
  } else {
    quantize_and_multiply<false, T>(x, packed, scales, bias, p1, p2, d, digit_sums, y);
  }
}
#endif

}  // namespace

// Whether int8_amx_linear runs here: this build has it and the CPU and OS run AMX-INT8 tiles.
bool int8_amx_available() {
#if defined(NANOVLLM_AMX_INT8)
  static const bool usable = amx_int8_usable();
  return usable;
#else
  return false;
#endif
}

// int8 codes [N, K] in the tiles' layout: uint8 [ceil(N / 16), K' * 16] (K' = K rounded up to 64), each block
// [K' / 4][16][4] of w + 128, features past N and values past K zero weights. Called once per linear at load.
at::Tensor pack_int8_amx(at::Tensor codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.device().is_cpu(),
              "pack_int8_amx: codes must be a 2-D int8 CPU tensor");
  const int64_t n = codes.size(0), k = codes.size(1);
  const int64_t n_blocks = (n + kFeatures - 1) / kFeatures, kp = padded_k(k);
  auto padded = at::zeros({n_blocks * kFeatures, kp}, codes.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(codes);
  // [blocks, 16, K'/4, 4] -> [blocks, K'/4, 16, 4], then + 128 as unsigned bytes.
  auto blocked = padded.view({n_blocks, kFeatures, kp / 4, 4}).permute({0, 2, 1, 3}).contiguous();
  return (blocked.to(at::kShort) + 128).to(at::kByte).view({n_blocks, kp * kFeatures});
}

// x [rows, K] float32 or bfloat16, quantized per token in `digits` int8 digits (1 or 2), times the packed int8
// weight of out_features outputs with float32 channel scales [N] (+ bias [N] in x's dtype); [rows, N] in x's dtype.
at::Tensor int8_amx_linear(at::Tensor x, at::Tensor packed, at::Tensor scales,
                              c10::optional<at::Tensor> bias, int64_t out_features, int64_t digits) {
  TORCH_CHECK(int8_amx_available(), "int8_amx_linear: this CPU, OS or kernel build has no AMX-INT8 tiles");
  TORCH_CHECK(digits == 1 || digits == 2, "int8_amx_linear: digits must be 1 or 2, got ", digits);
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "int8_amx_linear: x must be [rows, K] on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8_amx_linear: x must be float32 or bfloat16");
  x = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = out_features, kp = padded_k(k);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(1) == kp * kFeatures && packed.size(0) * kFeatures >= n,
              "int8_amx_linear: the packed weight does not match K or N");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n,
              "int8_amx_linear: scales must be float32 [N]");
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == n, "int8_amx_linear: bias [N] in x's dtype");
    bias_c = bias->contiguous();
  }
  auto y = at::empty({rows, n}, x.options());
#if defined(NANOVLLM_AMX_INT8)
  if (rows == 0) return y;
  // Whole tiles of rows from 16 rows on (the padding rows' digits are zero and their sums never read).
  const int64_t padded_rows = rows < kTileRows ? rows : (rows + kTileRows - 1) / kTileRows * kTileRows;
  // The digits, scales and digit sums are this thread's scratch (scratch.h), not a torch allocation per call.
  using nanovllm::Scratch, nanovllm::thread_scratch;
  auto p1 = thread_scratch(Scratch::kCodes, {padded_rows, kp}, at::kChar);
  auto p2 = digits == 2 ? thread_scratch(Scratch::kCodes2, {padded_rows, kp}, at::kChar) : at::Tensor();
  std::fill(p1.data_ptr<int8_t>() + rows * kp, p1.data_ptr<int8_t>() + padded_rows * kp, 0);
  if (digits == 2) std::fill(p2.data_ptr<int8_t>() + rows * kp, p2.data_ptr<int8_t>() + padded_rows * kp, 0);
  auto d = thread_scratch(Scratch::kScales, {rows}, at::kFloat);
  auto digit_sums = thread_scratch(Scratch::kCodeSums, {rows, 2}, at::kInt);
  if (x.scalar_type() == at::kFloat) {
    quantize_and_multiply<float>(digits, x, packed, scales, bias_c, p1, p2, d, digit_sums, y);
  } else {
    quantize_and_multiply<c10::BFloat16>(digits, x, packed, scales, bias_c, p1, p2, d, digit_sums, y);
  }
#endif
  return y;
}

// A torch operator too, so profiles count it as a linear layer.
#ifndef NANOVLLM_OPS
#define NANOVLLM_OPS nanovllm
#endif
TORCH_LIBRARY_FRAGMENT(NANOVLLM_OPS, m) {
  m.def("int8_amx_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int out_features, int digits=2) -> Tensor");
}
TORCH_LIBRARY_IMPL(NANOVLLM_OPS, CPU, m) { m.impl("int8_amx_linear", &int8_amx_linear); }
