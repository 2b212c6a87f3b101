// Paged attention for CPU over nano-vllm's KV cache layout [num_blocks, block_size, num_kv_heads, head_dim].
//
// One call per layer does two things: writes the step's new K/V rows into their cache slots, then computes
// attention for every query token of the flat batch. Token t of the batch belongs to sequence seq[t] and sits
// at absolute position pos[t], so it attends to keys 0..pos[t] of that sequence (causal, prefix cached or
// not): decodes, prefill chunks on top of a cached prefix and whole prompts are the same loop, with no padding
// and no mask. Work items are (token, kv head) pairs spread over OpenMP threads; one item serves the
// num_heads / num_kv_heads query heads that share the KV head (GQA without repeating K/V), reading each key
// once for the whole group. Softmax is exact two-pass (scores, max, exp-sum) in float32, whatever the
// storage dtype.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>


namespace {

using nanovllm::to_float;
#if defined(__AVX512F__)
using nanovllm::load16;
using nanovllm::sum_each16;
#elif defined(__AVX2__)
using nanovllm::load8;
using nanovllm::sum_each8;
#endif

// 8-bit caches (kv_cache_dtype=int8 / fp8_e4m3): the codes' format, and the float32 scale that follows a row's
// head_dim codes (the layout is described with the 8-bit entry point below).
enum class KVCodes { kInt8, kFp8E4M3 };
constexpr int64_t kScaleBytes = 4;

inline float row_scale(const uint8_t* row, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, row + head_dim, sizeof(float));
  return scale;
}

// The cache slot of key ``key`` of a sequence, from its block table ``table`` (paged: block key / block_size,
// row key % block_size within it). The kernels look a slot up per key; for a power-of-two block size that is a
// shift and a mask, where a 64-bit division had taken a measurable share of the int8 cache's decode attention
// (experiments/bench_decode_attention.py --hot).
inline int64_t key_slot(const int32_t* table, int64_t key, int64_t block_size) {
  if ((block_size & (block_size - 1)) == 0) {  // a power of two (the engine's 16): a shift and a mask
    const int shift = __builtin_ctzll(static_cast<uint64_t>(block_size));
    return (static_cast<int64_t>(table[key >> shift]) << shift) | (key & (block_size - 1));
  }
  return static_cast<int64_t>(table[key / block_size]) * block_size + key % block_size;
}

#if defined(__AVX2__)
// The cache rows of one work item (one sequence's keys for one KV head), fetched into L2 ahead of the vector
// kernels' loads.
//
// A decode step reads every cached row of every sequence once per layer, from memory: the step's K/V (71 MB for
// 32 sequences of 96 tokens in the default model) is far larger than the caches, and one KV head's rows sit a
// whole token's row of heads apart, in 16-token blocks scattered over the cache, where the hardware prefetchers
// (which follow a stream only once it has run a while) start late in every block. Left to them, the kernels
// waited on the loads, reading K/V well below the copy bandwidth (experiments/bench_decode_attention.py;
// docs/speed.md), and P.V waited most, its rows first touched after the softmax.
// So the kernels fetch ahead: each group of kAhead keys in pass 1 fetches the next group's key rows, and the
// same group's value rows while within kValuesAhead keys of the start; pass 2 keeps kValuesAhead keys ahead.
// Into L2 (prefetcht1), not L1: a T0 prefetch holds one of L1's few miss buffers until its line arrives, and a
// group's worth of them was no faster than none. Only for a sequence's lone query token (a decode): the tokens
// of a prefill chunk share their sequence's rows, which stay in cache after the first token, and there the
// prefetches were pure overhead (a long prefill's attention took longer with them).
template <typename Cache>
struct RowPrefetch {
  const Cache* k_cache;
  const Cache* v_cache;
  const int32_t* table;
  int64_t block_size, kv_row, head_offset, row_bytes;
  int64_t num_keys;  // the keys to fetch: the item's, or 0 for a token that shares its sequence with others

  static constexpr int64_t kAhead = 16;         // keys fetched by one call
  static constexpr int64_t kValuesAhead = 256;  // how far pass 2's value rows are fetched ahead (32 KB of bf16)

  // Pass 1, at every key `first` that is a multiple of kAhead.
  void pass1(int64_t first) const {
    rows(k_cache, first + kAhead);
    if (first < kValuesAhead) rows(v_cache, first);
  }
  // Pass 2 (or the loop that first reads the value rows), at every key that is a multiple of kAhead.
  void pass2(int64_t key) const { rows(v_cache, key + kValuesAhead); }

 private:
  // Rows of keys [first, first + kAhead), clipped to the item's keys; every line of each (an 8-bit row, head_dim
  // + 4 bytes, may straddle a line boundary).
  void rows(const Cache* cache, int64_t first) const {
    const int64_t end = std::min(first + kAhead, num_keys);
    if (first >= end) return;
    int64_t block = first / block_size, within = first % block_size;  // walked, not divided again per key
    for (int64_t key = first; key < end; ++key) {
      const int64_t slot = static_cast<int64_t>(table[block]) * block_size + within;
      const char* row = reinterpret_cast<const char*>(cache + slot * kv_row + head_offset);
      const int64_t skip = reinterpret_cast<uintptr_t>(row) % 64;  // the row's offset in its first line
      for (int64_t offset = -skip; offset < row_bytes; offset += 64) nanovllm::prefetch_l2(row + offset);
      if (++within == block_size) {
        within = 0;
        ++block;
      }
    }
  }
};
#endif

// Whether token t is its sequence's only query token in the batch (a decode), so that its rows are read once
// (tokens of one sequence are adjacent in the flat batch: the model runner lays a sequence's chunk out together).
inline bool lone_query(const int32_t* seq, int64_t t, int64_t num_tokens) {
  return (t == 0 || seq[t - 1] != seq[t]) && (t + 1 == num_tokens || seq[t + 1] != seq[t]);
}

// The factor the vector kernels' decoded codes are off by, absorbed into the row's scale: 1 for int8; 256 for
// e4m3, which they decode through float16's bit layout (decode16 / decode8 below), giving the value times 2^-8.
template <KVCodes C>
constexpr float decode_factor() { return C == KVCodes::kInt8 ? 1.f : 256.f; }

// Each of the group's rows of scores (num_keys each) replaced by its softmax, in place: the portable loops'
// normalization, shared by the model-dtype and the 8-bit kernels.
inline void softmax_rows(float* scores, int64_t group, int64_t num_keys) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * num_keys;
    float m = sg[0];
    for (int64_t key = 1; key < num_keys; ++key) m = sg[key] > m ? sg[key] : m;
    float sum = 0.f;
    for (int64_t key = 0; key < num_keys; ++key) {
      sg[key] = std::exp(sg[key] - m);
      sum += sg[key];
    }
    const float inv = 1.f / sum;
    for (int64_t key = 0; key < num_keys; ++key) sg[key] *= inv;
  }
}

template <typename scalar_t>
void write_kv(const scalar_t* k, const scalar_t* v, const int64_t* slots, scalar_t* k_cache, scalar_t* v_cache,
              int64_t num_tokens, int64_t row, int64_t k_stride, int64_t v_stride) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::memcpy(k_cache + slots[t] * row, k + t * k_stride, row * sizeof(scalar_t));
    std::memcpy(v_cache + slots[t] * row, v + t * v_stride, row * sizeof(scalar_t));
  }
}

template <typename scalar_t>
void attend(const scalar_t* q, int64_t q_stride, const scalar_t* k_cache, const scalar_t* v_cache,
            const int32_t* block_tables, int64_t max_blocks, const int32_t* seq, const int32_t* pos, scalar_t* out, int64_t num_tokens,
            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t kv_row = num_kv_heads * head_dim;  // elements per cache slot
#pragma omp parallel
  {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
#pragma omp for schedule(dynamic, 4)
    for (int64_t item = 0; item < num_tokens * num_kv_heads; ++item) {
      const int64_t t = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t num_keys = static_cast<int64_t>(pos[t]) + 1;
      const int32_t* table = block_tables + static_cast<int64_t>(seq[t]) * max_blocks;
      scores.resize(group * num_keys);
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* qh = q + t * q_stride + (h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_float(qh[d]) * scale;
      }
      // Pass 1: scores of every key for every query head of the group.
      for (int64_t key = 0; key < num_keys; ++key) {
        const int64_t slot = key_slot(table, key, block_size);
        const scalar_t* kp = k_cache + slot * kv_row + h * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * to_float(kp[d]);
          scores[g * num_keys + key] = s;
        }
      }
      softmax_rows(scores.data(), group, num_keys);
      // Pass 2: the probability-weighted sum of values.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t key = 0; key < num_keys; ++key) {
        const int64_t slot = key_slot(table, key, block_size);
        const scalar_t* vp = v_cache + slot * kv_row + h * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * num_keys + key];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * to_float(vp[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* oh = out + (t * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) oh[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  }
}


#if defined(__AVX2__)
// Calls fn(std::integral_constant<int, D>, std::integral_constant<int, G>) for the head_dim D and GQA group
// size G the vectorized kernels are instantiated for (their registers are sized at compile time); false, without
// calling, for any other shape, which then takes the portable loop.
template <typename Fn>
bool with_head_shape(int64_t head_dim, int64_t group, Fn&& fn) {
#define NANOVLLM_SHAPE(D, G)                                                     \
  if (head_dim == D && group == G) {                                             \
    fn(std::integral_constant<int, D>{}, std::integral_constant<int, G>{});      \
    return true;                                                                 \
  }
  NANOVLLM_SHAPE(64, 1) NANOVLLM_SHAPE(64, 2) NANOVLLM_SHAPE(64, 3) NANOVLLM_SHAPE(64, 4)
  NANOVLLM_SHAPE(64, 5) NANOVLLM_SHAPE(64, 6) NANOVLLM_SHAPE(64, 7) NANOVLLM_SHAPE(64, 8)
  NANOVLLM_SHAPE(128, 1) NANOVLLM_SHAPE(128, 2) NANOVLLM_SHAPE(128, 3) NANOVLLM_SHAPE(128, 4)
  NANOVLLM_SHAPE(128, 5) NANOVLLM_SHAPE(128, 6) NANOVLLM_SHAPE(128, 7) NANOVLLM_SHAPE(128, 8)
#undef NANOVLLM_SHAPE
  return false;
}

// ---- how the vector kernels read cache rows (attend_avx512 on AVX-512 builds, attend_avx2 on the avx2 build) ----
#if defined(__AVX512F__)
// 16 codes of an 8-bit row as float32 lanes, up to the factor decode_factor<C>() that the row's scale absorbs.
// int8: sign-extended. e4m3: each byte becomes the float16 with the same sign, exponent and mantissa bits
// (s eeee mmm -> s 0eeee mmm0000000), which is the e4m3 value times 2^-8 for normal and subnormal codes alike
// (float16's exponent bias is 15, e4m3's 7), so one exact conversion instruction replaces the table lookup.
template <KVCodes C>
inline __m512 decode16(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (C == KVCodes::kInt8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
  } else {
    const __m256i b = _mm256_cvtepu8_epi16(raw);
    const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                         _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
    return _mm512_cvtph_ps(half);
  }
}

using Lanes = __m512;  // the build's float32 vector: 16 lanes here, 8 on the avx2 build
template <typename T>
inline Lanes load_lanes(const T* p) { return load16(p); }
template <KVCodes C>
inline Lanes decode_lanes(const uint8_t* p) { return decode16<C>(p); }
#else
// 8 codes of an 8-bit row as float32 lanes, up to decode_factor<C>(): decode16's two ways (int8 sign-extended;
// e4m3 through float16's bit layout, one exact F16C conversion) at 8 lanes.
template <KVCodes C>
inline __m256 decode8(const uint8_t* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (C == KVCodes::kInt8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
  } else {
    const __m128i b = _mm_cvtepu8_epi16(raw);
    const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                      _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
    return _mm256_cvtph_ps(half);
  }
}

using Lanes = __m256;
template <typename T>
inline Lanes load_lanes(const T* p) { return load8(p); }
template <KVCodes C>
inline Lanes decode_lanes(const uint8_t* p) { return decode8<C>(p); }
#endif

// Rows in the model dtype: head_dim values as stored.
template <typename scalar_t, int D>
struct ModelRows {
  using Cache = scalar_t;
  static constexpr int64_t kRow = D;  // cache elements per (token, KV head) row
  static constexpr bool kScaled = false;
  static Lanes load(const scalar_t* p) { return load_lanes(p); }
  static float scale(const scalar_t*) { return 1.f; }
#if defined(__AVX512BF16__)
  static constexpr bool kInt16Dot = false;
  // 32 values as bf16 pairs for the dot-product kernel (attend_avx512_bf16; bfloat16 rows only), as stored.
  static __m512bh load_bf16(const scalar_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }
#endif
};

// Rows of an 8-bit cache: head_dim codes then the row's float32 scale (nanovllm/attention/kv_quant.py's layout).
// Half the bytes of a bfloat16 row per key, and two instructions per vector of values to decode.
template <KVCodes C, int D>
struct EightBitRows {
  using Cache = uint8_t;
  static constexpr int64_t kRow = D + kScaleBytes;
  static constexpr bool kScaled = true;
  static Lanes load(const uint8_t* p) { return decode_lanes<C>(p); }
  static float scale(const uint8_t* row) { return row_scale(row, D) * decode_factor<C>(); }
#if defined(__AVX512BF16__)
  // 32 codes as bf16 for the dot-product kernel: decoded to float32, then packed. Both steps are exact: an int8
  // code is an integer of at most 8 bits and e4m3 has 3 mantissa bits, both within bf16's 8.
  static __m512bh load_bf16(const uint8_t* p) { return _mm512_cvtne2ps_pbh(decode16<C>(p + 16), decode16<C>(p)); }
#if defined(__AVX512VNNI__)
  // int8 codes are integers: the dot-product kernel's Q.K^T takes them widened to int16 (one instruction per 32
  // codes, where bf16 takes five) against the query in int16 (vpdpwssd).
  static constexpr bool kInt16Dot = C == KVCodes::kInt8;
  static __m512i load_i16(const uint8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
#else
  static constexpr bool kInt16Dot = false;
#endif
#endif
};

#endif  // __AVX2__

#if defined(__AVX2__)
// Before the vector kernels' pass 2 (attend_avx512, attend_avx2): each key's value row located into value_rows
// (fetching rows ahead, RowPrefetch::pass2), and an 8-bit row's scale folded into its key's G weights in
// `weights` (rows of `stride`; after the exp-sum, which the normalization divides by).
template <typename Rows, int G, typename SlotRow>
inline void locate_value_rows(const RowPrefetch<typename Rows::Cache>& ahead, SlotRow slot_row,
                              const typename Rows::Cache* v_cache, int64_t num_keys, int64_t stride,
                              std::vector<const typename Rows::Cache*>& value_rows, float* weights) {
  value_rows.resize(num_keys);
  for (int64_t key = 0; key < num_keys; ++key) {
    if (key % RowPrefetch<typename Rows::Cache>::kAhead == 0) ahead.pass2(key);
    value_rows[key] = slot_row(v_cache, key);
    if constexpr (Rows::kScaled) {
      const float value_scale = Rows::scale(value_rows[key]);
      for (int g = 0; g < G; ++g) weights[g * stride + key] *= value_scale;
    }
  }
}
#endif

#if defined(__AVX512F__)
// Softmax numerators exp(s - max) of one query head's scores ``sg`` over ``num_keys`` keys, 16 at a time (lanes
// past the last key are 0): ``store(key, e)`` keeps each group of 16 where the caller wants it and returns them
// as stored, and the result is 1 / the sum of the stored values (the normalization is applied at the end).
template <typename Store>
inline float softmax_numerators(const float* sg, int64_t num_keys, Store store) {
  const auto mask = [num_keys](int64_t key) {
    return num_keys - key >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (num_keys - key)) - 1);
  };
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t key = 0; key < num_keys; key += 16) mx = _mm512_mask_max_ps(mx, mask(key), mx, _mm512_loadu_ps(sg + key));
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t key = 0; key < num_keys; key += 16) {
    const __m512 e = _mm512_maskz_mov_ps(mask(key), nanovllm::exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + key), max)));
    sum = _mm512_add_ps(sum, store(key, e));
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// The AVX-512 path: the same arithmetic as ``attend`` above, organised for the vector unit. For each work item
// (token, KV head) it runs, 16 keys at a time: convert the 16 key rows to a float32 tile once, take each query
// head's 16 dot products as 16 vectors and reduce them together into one vector of 16 scores (a transposing
// add tree: ~3 instructions per score instead of a full horizontal sum each); then one vectorized exp pass
// (nanovllm::exp16, cpu_vec.h); then the weighted sum of values with the group's accumulators held in registers
// (head_dim and the group size are template parameters so the compiler can keep them there). Normalization by
// the exp-sum happens once, at the end. Rows is how it reads the cache (ModelRows: values in the model dtype as
// stored; EightBitRows: 8-bit codes decoded 16 at a time, each row's scale multiplying its key's tile row and its
// value's probability).
template <typename scalar_t, typename Rows, int D, int G>
void attend_avx512(const scalar_t* q, int64_t q_stride, const typename Rows::Cache* k_cache,
                   const typename Rows::Cache* v_cache, const int32_t* block_tables, int64_t max_blocks,
                   const int32_t* seq, const int32_t* pos, scalar_t* out, int64_t num_tokens, int64_t num_kv_heads,
                   int64_t block_size, float scale) {
  using Cache = typename Rows::Cache;
  constexpr int V = D / 16;  // vectors per head row
  const int64_t num_heads = num_kv_heads * G, kv_row = num_kv_heads * Rows::kRow;
#pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<const Cache*> value_rows;
    alignas(64) float tile[16][D];
    alignas(64) float key_scales[16];  // an 8-bit tile's row scales, applied to its 16 scores at once
    alignas(64) float result[G * D];
#pragma omp for schedule(dynamic, 2)
    for (int64_t item = 0; item < num_tokens * num_kv_heads; ++item) {
      const int64_t t = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t num_keys = static_cast<int64_t>(pos[t]) + 1, stride = (num_keys + 15) / 16 * 16;
      const int32_t* table = block_tables + static_cast<int64_t>(seq[t]) * max_blocks;
      const auto slot_row = [&](const Cache* cache, int64_t key) {
        const int64_t slot = key_slot(table, key, block_size);
        return cache + slot * kv_row + h * Rows::kRow;
      };
      scores.resize(G * stride);
      __m512 qv[G][V];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < V; ++j)
          qv[g][j] = _mm512_mul_ps(load16(q + t * q_stride + (h * G + g) * D + 16 * j), _mm512_set1_ps(scale));
      const RowPrefetch<Cache> ahead{k_cache, v_cache, table, block_size, kv_row, h * Rows::kRow,
                                     Rows::kRow * static_cast<int64_t>(sizeof(Cache)),
                                     lone_query(seq, t, num_tokens) ? num_keys : 0};
      // Pass 1: scores, 16 keys at a time.
      for (int64_t first = 0; first < num_keys; first += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, num_keys - first));
        ahead.pass1(first);
        for (int k = 0; k < n; ++k) {
          const Cache* kp = slot_row(k_cache, first + k);
          if constexpr (Rows::kScaled) key_scales[k] = Rows::scale(kp);
          for (int j = 0; j < V; ++j) _mm512_store_ps(&tile[k][16 * j], Rows::load(kp + 16 * j));
        }
        if constexpr (Rows::kScaled)
          for (int k = n; k < 16; ++k) key_scales[k] = 0.f;
        for (int g = 0; g < G; ++g) {
          __m512 dots[16];
          for (int k = 0; k < 16; ++k) {
            if (k >= n) {
              dots[k] = _mm512_setzero_ps();
              continue;
            }
            __m512 acc = _mm512_mul_ps(qv[g][0], _mm512_load_ps(&tile[k][0]));
            for (int j = 1; j < V; ++j) acc = _mm512_fmadd_ps(qv[g][j], _mm512_load_ps(&tile[k][16 * j]), acc);
            dots[k] = acc;
          }
          // An 8-bit key's scale multiplies its score, not its 64 decoded values (one vector op per 16 keys).
          const __m512 sums = sum_each16(dots);
          _mm512_storeu_ps(scores.data() + g * stride + first,
                           Rows::kScaled ? _mm512_mul_ps(sums, _mm512_load_ps(key_scales)) : sums);
        }
      }
      // Softmax numerators exp(s - max) in place; the normalization waits until the end.
      float inv_sum[G];
      for (int g = 0; g < G; ++g) {
        float* sg = scores.data() + g * stride;
        inv_sum[g] = softmax_numerators(sg, num_keys, [&](int64_t key, __m512 e) {
          _mm512_storeu_ps(sg + key, e);
          return e;
        });
      }
      // Each value row located first (no block-table lookup inside pass 2), its scale in the weights.
      locate_value_rows<Rows, G>(ahead, slot_row, v_cache, num_keys, stride, value_rows, scores.data());
      // Pass 2: the weighted sum of values, accumulators in registers.
      __m512 acc[G][V];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < V; ++j) acc[g][j] = _mm512_setzero_ps();
      const float* weights = scores.data();
      for (int64_t key = 0; key < num_keys; ++key) {
        const Cache* vp = value_rows[key];
        __m512 vv[V];
        for (int j = 0; j < V; ++j) vv[j] = Rows::load(vp + 16 * j);
        for (int g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(weights[g * stride + key]);
          for (int j = 0; j < V; ++j) acc[g][j] = _mm512_fmadd_ps(p, vv[j], acc[g][j]);
        }
      }
      for (int g = 0; g < G; ++g) {
        for (int j = 0; j < V; ++j)
          _mm512_store_ps(result + g * D + 16 * j, _mm512_mul_ps(acc[g][j], _mm512_set1_ps(inv_sum[g])));
        scalar_t* oh = out + (t * num_heads + h * G + g) * D;
        for (int d = 0; d < D; ++d) oh[d] = static_cast<scalar_t>(result[g * D + d]);
      }
    }
  }
}

#if defined(__AVX512BF16__)
// 16 float32 values times `inv` (32767 / their step's largest value), rounded to the nearest int16: the int8
// cache's integer products take the query and the softmax weights this way.
inline __m256i to_int16(__m512 v, __m512 inv) {
  return _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)));
}

// The bfloat16 path on CPUs with AVX-512 BF16: both matrix products on the bf16 dot-product instruction
// (vdpbf16ps: each float32 lane accumulates two bf16 products), as GPU kernels run them on bf16 tensor cores.
// Q.K^T reads the cached K rows as stored (no conversion to float32): a 64-wide row is two instructions per
// query head. P.V rounds the probabilities to bf16 (as FlashAttention does) and takes two keys per instruction,
// their V rows interleaved element by element; the accumulators then hold each 32-wide slice of the head in a
// fixed lane order (unpacklo/unpackhi of 128-bit lanes), put back in order once at the end. Softmax, its
// normalization and all accumulation stay float32.
//
// Rows is how it reads the cache: ModelRows for a bfloat16 cache; EightBitRows for an 8-bit one (bfloat16 models
// only), each K row's scale multiplying its 16 scores after the dot products and each V row's scale folded into
// its key's weight. e4m3 codes become bf16 exactly (Rows::load_bf16) and take the bf16 products above. int8 codes
// are integers and take integer products (Rows::kInt16Dot, vpdpwssd: int16 pairs into int32): the codes widened
// to int16 (one instruction per 32, where decoding to bf16 takes five), the query in int16 with one step per
// query head and the weights in int16 with one step per query head and item, both 1/32767 of the largest, finer
// than bf16's 8 bits for every value that weighs. Decoding codes to float32 for FMAs (attend_avx512) had made the
// 8-bit cache slower per step than the bfloat16 one despite half the bytes; docs/kv_cache_dtype.md has the timings.
template <typename Rows, int D, int G>
void attend_avx512_bf16(const c10::BFloat16* q, int64_t q_stride, const typename Rows::Cache* k_cache,
                        const typename Rows::Cache* v_cache, const int32_t* block_tables, int64_t max_blocks,
                        const int32_t* seq, const int32_t* pos, c10::BFloat16* out, int64_t num_tokens,
                        int64_t num_kv_heads, int64_t block_size, float scale) {
  using Cache = typename Rows::Cache;
  constexpr int W = D / 32;  // bf16 vectors of 32 per head row
  const int64_t num_heads = num_kv_heads * G, kv_row = num_kv_heads * Rows::kRow;
  // A token's KV heads (consecutive items) on one thread, one after the other, once there are tokens enough to
  // share out (4 chunks a thread): the heads' rows lie side by side in each cache slot, so the cache lines one
  // head fetches hold part of the next head's row. (An 8-bit row, 68 bytes, shares lines with its neighbours
  // most of the time.) With fewer tokens, items of 1 key head keep every thread busy.
  const int64_t chunk = num_tokens >= 4 * omp_get_max_threads() ? num_kv_heads : 1;
#pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<uint16_t> probs;  // bf16 bit patterns of the softmax numerators, padded with a zero
    std::vector<const Cache*> value_rows;  // 8-bit caches: each key's V row, located before pass 2
    std::vector<float> value_scales;       // and its scale, padded with zeros to a multiple of 16 keys
    alignas(64) float key_scales[16];      // 8-bit caches: the scales of 16 keys' K rows
    alignas(64) __m512bh key_tile[16][W];  // and the rows as bf16, converted once for the G query heads
    alignas(64) __m512i key_tile16[16][W];  // or as int16 (Rows::kInt16Dot)
#pragma omp for schedule(dynamic, chunk)
    for (int64_t item = 0; item < num_tokens * num_kv_heads; ++item) {
      const int64_t t = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t num_keys = static_cast<int64_t>(pos[t]) + 1, stride = (num_keys + 15) / 16 * 16;
      const int32_t* table = block_tables + static_cast<int64_t>(seq[t]) * max_blocks;
      const auto slot_row = [&](const Cache* cache, int64_t key) {
        const int64_t slot = key_slot(table, key, block_size);
        return cache + slot * kv_row + h * Rows::kRow;
      };
      scores.resize(G * stride);
      probs.resize(G * stride);
      __m512bh qv[G][W];
      __m512i q16[G][W];  // Rows::kInt16Dot: each query head in int16, q16 * q_step[g] ~ q
      float q_step[G];
      for (int g = 0; g < G; ++g) {
        const c10::BFloat16* qg = q + t * q_stride + (h * G + g) * D;
        if constexpr (Rows::kInt16Dot) {
          // One scale per query head, max|q| / 32767: a step 1/32767 of the largest element, where bf16 itself
          // holds each element to 1/256 of its own size, so the products stay as exact as the bf16 kernel's.
          __m512 lanes[2 * W], peak = _mm512_setzero_ps();
          for (int i = 0; i < 2 * W; ++i) {
            lanes[i] = load16(qg + 16 * i);
            peak = _mm512_max_ps(peak, _mm512_abs_ps(lanes[i]));
          }
          const float amax = _mm512_reduce_max_ps(peak);
          const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
          q_step[g] = amax / 32767.f;
          for (int j = 0; j < W; ++j) {
            const __m256i lo = to_int16(lanes[2 * j], inv);
            const __m256i hi = to_int16(lanes[2 * j + 1], inv);
            q16[g][j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
          }
        } else {
          for (int j = 0; j < W; ++j) qv[g][j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qg + 32 * j));
        }
      }
      const RowPrefetch<Cache> ahead{k_cache, v_cache, table, block_size, kv_row, h * Rows::kRow,
                                     Rows::kRow * static_cast<int64_t>(sizeof(Cache)),
                                     lone_query(seq, t, num_tokens) ? num_keys : 0};
      // Pass 1: scaled scores, 16 keys at a time, reduced together (sum_each16).
      const __m512 scale16 = _mm512_set1_ps(scale);
      for (int64_t first = 0; first < num_keys; first += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, num_keys - first));
        ahead.pass1(first);
        const Cache* rows[16];
        for (int k = 0; k < n; ++k) {
          rows[k] = slot_row(k_cache, first + k);
          if constexpr (Rows::kScaled) {
            key_scales[k] = Rows::scale(rows[k]);
            for (int j = 0; j < W; ++j) {
              if constexpr (Rows::kInt16Dot) key_tile16[k][j] = Rows::load_i16(rows[k] + 32 * j);
              else key_tile[k][j] = Rows::load_bf16(rows[k] + 32 * j);
            }
          }
        }
        if constexpr (Rows::kScaled)
          for (int k = n; k < 16; ++k) key_scales[k] = 0.f;
        const __m512 score_scale = Rows::kScaled ? _mm512_mul_ps(_mm512_load_ps(key_scales), scale16) : scale16;
        if constexpr (Rows::kInt16Dot) {
          for (int g = 0; g < G; ++g) {
            __m512i dots[16];  // int32: at most 64 products of 127 x 32767 each, far below 2^31
            for (int k = 0; k < 16; ++k) {
              __m512i acc = _mm512_setzero_si512();
              if (k < n)
                for (int j = 0; j < W; ++j) acc = _mm512_dpwssd_epi32(acc, q16[g][j], key_tile16[k][j]);
              dots[k] = acc;
            }
            _mm512_storeu_ps(scores.data() + g * stride + first,
                             _mm512_mul_ps(_mm512_cvtepi32_ps(sum_each16(dots)),
                                           _mm512_mul_ps(score_scale, _mm512_set1_ps(q_step[g]))));
          }
          continue;
        }
        for (int g = 0; g < G; ++g) {
          __m512 dots[16];
          for (int k = 0; k < 16; ++k) {
            __m512 acc = _mm512_setzero_ps();
            if (k < n)
              for (int j = 0; j < W; ++j) {
                if constexpr (Rows::kScaled) acc = _mm512_dpbf16_ps(acc, qv[g][j], key_tile[k][j]);
                else acc = _mm512_dpbf16_ps(acc, qv[g][j], Rows::load_bf16(rows[k] + 32 * j));
              }
            dots[k] = acc;
          }
          _mm512_storeu_ps(scores.data() + g * stride + first, _mm512_mul_ps(sum_each16(dots), score_scale));
        }
      }
      if constexpr (Rows::kScaled) {
        value_rows.resize(num_keys);
        value_scales.assign(stride, 0.f);
        for (int64_t key = 0; key < num_keys; ++key) {
          if (key % RowPrefetch<Cache>::kAhead == 0) ahead.pass2(key);
          value_rows[key] = slot_row(v_cache, key);
          value_scales[key] = Rows::scale(value_rows[key]);
        }
      }
      // Softmax numerators exp(s - max), rounded to bf16 for P.V (int8 caches: to int16, below); the
      // normalization waits until the end.
      float inv_sum[G], p_step[G];
      for (int g = 0; g < G; ++g) {
        uint16_t* pg = probs.data() + g * stride;
        float* sg = scores.data() + g * stride;
        __m512 peak = _mm512_setzero_ps();
        inv_sum[g] = softmax_numerators(sg, num_keys, [&](int64_t key, __m512 e) {
          if constexpr (Rows::kInt16Dot) {
            // The weight times the V row's scale, kept in float32 for now; the sum stays the numerators'.
            const __m512 weight = _mm512_mul_ps(e, _mm512_loadu_ps(value_scales.data() + key));
            _mm512_storeu_ps(sg + key, weight);
            peak = _mm512_max_ps(peak, weight);
            return e;
          } else if constexpr (Rows::kScaled) {
            // The weight P.V applies is the numerator times the V row's scale; the sum stays the numerators'.
            nanovllm::store16(reinterpret_cast<c10::BFloat16*>(pg + key),
                              _mm512_mul_ps(e, _mm512_loadu_ps(value_scales.data() + key)));
            return e;
          } else {
            // The sum is of the rounded numerators, so that the weights P.V applies sum to one.
            nanovllm::store16(reinterpret_cast<c10::BFloat16*>(pg + key), e);
            return nanovllm::round16(e, static_cast<c10::BFloat16*>(nullptr));
          }
        });
        if constexpr (Rows::kInt16Dot) {
          // The weights in int16 against the largest: a step of 1/32767 of it, so the weights that matter are
          // held to ~1e-5 of their size (bf16's: 1/256), and the small ones to an error far below their share.
          const float amax = _mm512_reduce_max_ps(peak);
          const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
          p_step[g] = amax / 32767.f;
          for (int64_t key = 0; key < stride; key += 16)  // lanes past the last key are 0, the pair padding too
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pg + key),
                                to_int16(_mm512_loadu_ps(sg + key), inv));
        }
      }
      // Pass 2: two keys per step; lane 2i / 2i+1 of each 32-bit pair holds key / key + 1.
      __m512 lo[G][W], hi[G][W];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < W; ++j) lo[g][j] = hi[g][j] = _mm512_setzero_ps();
      if constexpr (Rows::kInt16Dot) {
        // int8 caches: the V codes widened to int16, times the int16 weights (vpdpwssd), into int32 sums that
        // go to the float32 accumulators every kFlush keys (|sum| <= kFlush * 32767 * 127 < 2^31).
        constexpr int64_t kFlush = 256;
        for (int64_t begin = 0; begin < num_keys; begin += kFlush) {
          __m512i lo_i[G][W], hi_i[G][W];
          for (int g = 0; g < G; ++g)
            for (int j = 0; j < W; ++j) lo_i[g][j] = hi_i[g][j] = _mm512_setzero_si512();
          for (int64_t key = begin; key < std::min(num_keys, begin + kFlush); key += 2) {
            const Cache* va = value_rows[key];
            const Cache* vb = key + 1 < num_keys ? value_rows[key + 1] : nullptr;
            __m512i pairs_lo[W], pairs_hi[W];
            for (int j = 0; j < W; ++j) {
              const __m512i a = Rows::load_i16(va + 32 * j);
              const __m512i b = vb ? Rows::load_i16(vb + 32 * j) : _mm512_setzero_si512();
              pairs_lo[j] = _mm512_unpacklo_epi16(a, b);
              pairs_hi[j] = _mm512_unpackhi_epi16(a, b);
            }
            for (int g = 0; g < G; ++g) {
              int32_t pair;  // (p[key], p[key + 1]) as two int16; p[num_keys] is the zero padding
              std::memcpy(&pair, probs.data() + g * stride + key, sizeof(pair));
              const __m512i p = _mm512_set1_epi32(pair);
              for (int j = 0; j < W; ++j) {
                lo_i[g][j] = _mm512_dpwssd_epi32(lo_i[g][j], pairs_lo[j], p);
                hi_i[g][j] = _mm512_dpwssd_epi32(hi_i[g][j], pairs_hi[j], p);
              }
            }
          }
          for (int g = 0; g < G; ++g)
            for (int j = 0; j < W; ++j) {
              lo[g][j] = _mm512_add_ps(lo[g][j], _mm512_cvtepi32_ps(lo_i[g][j]));
              hi[g][j] = _mm512_add_ps(hi[g][j], _mm512_cvtepi32_ps(hi_i[g][j]));
            }
        }
        for (int g = 0; g < G; ++g) inv_sum[g] *= p_step[g];  // the weights' int16 step, applied once
      } else {
        for (int64_t key = 0; key < num_keys; key += 2) {
          const Cache *va, *vb;
          if constexpr (Rows::kScaled) {
            va = value_rows[key];
            vb = key + 1 < num_keys ? value_rows[key + 1] : nullptr;
          } else {
            if (key % RowPrefetch<Cache>::kAhead == 0) ahead.pass2(key);
            va = slot_row(v_cache, key);
            vb = key + 1 < num_keys ? slot_row(v_cache, key + 1) : nullptr;
          }
          __m512i pairs_lo[W], pairs_hi[W];
          for (int j = 0; j < W; ++j) {
            const __m512i a = reinterpret_cast<__m512i>(Rows::load_bf16(va + 32 * j));
            const __m512i b = vb ? reinterpret_cast<__m512i>(Rows::load_bf16(vb + 32 * j)) : _mm512_setzero_si512();
            pairs_lo[j] = _mm512_unpacklo_epi16(a, b);
            pairs_hi[j] = _mm512_unpackhi_epi16(a, b);
          }
          for (int g = 0; g < G; ++g) {
            uint32_t pair;  // (p[key], p[key + 1]) as two bf16; p[num_keys] is the zero padding
            std::memcpy(&pair, probs.data() + g * stride + key, sizeof(pair));
            const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
            for (int j = 0; j < W; ++j) {
              lo[g][j] = _mm512_dpbf16_ps(lo[g][j], reinterpret_cast<__m512bh>(pairs_lo[j]), p);
              hi[g][j] = _mm512_dpbf16_ps(hi[g][j], reinterpret_cast<__m512bh>(pairs_hi[j]), p);
            }
          }
        }
      }
      // lo's 128-bit lane L holds elements 8L..8L+3 of the slice, hi's 8L+4..8L+7: interleave the lanes back.
      for (int g = 0; g < G; ++g) {
        const __m512 inv = _mm512_set1_ps(inv_sum[g]);
        c10::BFloat16* oh = out + (t * num_heads + h * G + g) * D;
        for (int j = 0; j < W; ++j) {
          const __m512 first = _mm512_shuffle_f32x4(lo[g][j], hi[g][j], _MM_SHUFFLE(1, 0, 1, 0));   // lo0 lo1 hi0 hi1
          const __m512 second = _mm512_shuffle_f32x4(lo[g][j], hi[g][j], _MM_SHUFFLE(3, 2, 3, 2));  // lo2 lo3 hi2 hi3
          constexpr int order = _MM_SHUFFLE(3, 1, 2, 0);
          nanovllm::store16(oh + 32 * j, _mm512_mul_ps(_mm512_shuffle_f32x4(first, first, order), inv));
          nanovllm::store16(oh + 32 * j + 16, _mm512_mul_ps(_mm512_shuffle_f32x4(second, second, order), inv));
        }
      }
    }
  }
}
#endif  // __AVX512BF16__

// The vectorized path for this dtype: the bf16 dot-product kernel where the CPU has it, else attend_avx512.
template <typename scalar_t, int D, int G>
void attend_vectorized(const scalar_t* q, int64_t q_stride, const scalar_t* k_cache, const scalar_t* v_cache,
                       const int32_t* block_tables, int64_t max_blocks, const int32_t* seq, const int32_t* pos,
                       scalar_t* out, int64_t num_tokens, int64_t num_kv_heads, int64_t block_size, float scale) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    attend_avx512_bf16<ModelRows<c10::BFloat16, D>, D, G>(q, q_stride, k_cache, v_cache, block_tables, max_blocks,
                                                         seq, pos, out, num_tokens, num_kv_heads, block_size, scale);
    return;
  }
#endif
  attend_avx512<scalar_t, ModelRows<scalar_t, D>, D, G>(q, q_stride, k_cache, v_cache, block_tables, max_blocks,
                                                        seq, pos, out, num_tokens, num_kv_heads, block_size, scale);
}

// Runs the AVX-512 path when it has an instantiation for this dtype, head_dim and group size.
template <typename scalar_t>
bool try_attend_avx512(const scalar_t* q, int64_t q_stride, const scalar_t* k_cache, const scalar_t* v_cache,
                       const int32_t* block_tables, int64_t max_blocks, const int32_t* seq, const int32_t* pos,
                       scalar_t* out, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, float scale) {
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    return with_head_shape(head_dim, num_heads / num_kv_heads, [&](auto d, auto g) {
      attend_vectorized<scalar_t, decltype(d)::value, decltype(g)::value>(
          q, q_stride, k_cache, v_cache, block_tables, max_blocks, seq, pos, out, num_tokens, num_kv_heads,
          block_size, scale);
    });
  }
  return false;
}
#endif  // __AVX512F__

#if defined(__AVX2__) && !defined(__AVX512F__)
// The AVX2 path (the avx2 build; AVX-512 builds run attend_avx512): attend's arithmetic in 8-wide vectors, with
// 16 registers. For each work item (token, KV head):
// - pass 1, 8 keys at a time: the 8 key rows become a float32 tile once; for each query head, 8 partial dot
//   products (one register each, the query read from L1 one 8-wide slice at a time) are reduced together into 8
//   scores (sum_each8), not one horizontal sum per key;
// - the softmax numerators with the vectorized exp (exp8, cpu_vec.h), normalized once at the end;
// - pass 2, the weighted sum of values, in slices of head_dim so that the group's accumulators, one broadcast
//   probability per head and the value vector fit the registers (G heads x C vectors of 8).
//
// Rows is how it reads the cache, as for attend_avx512: ModelRows (the model dtype as stored) or EightBitRows
// (8-bit codes decoded 8 at a time; the row's scale multiplies its key's tile row and its value's probability).
template <typename scalar_t, typename Rows, int D, int G>
void attend_avx2(const scalar_t* q, int64_t q_stride, const typename Rows::Cache* k_cache,
                 const typename Rows::Cache* v_cache, const int32_t* block_tables, int64_t max_blocks,
                 const int32_t* seq, const int32_t* pos, scalar_t* out, int64_t num_tokens, int64_t num_kv_heads,
                 int64_t block_size, float scale) {
  using Cache = typename Rows::Cache;
  constexpr int V = D / 8;                                     // vectors per head row
  constexpr int C = G <= 3 ? std::min(V, 4) : G <= 6 ? 2 : 1;  // vectors per slice in pass 2
  const int64_t num_heads = num_kv_heads * G, kv_row = num_kv_heads * Rows::kRow;
#pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<const Cache*> value_rows;
    alignas(32) float tile[8][D];
    alignas(32) float qf[G][D];
    alignas(32) float result[G * D];
#pragma omp for schedule(dynamic, 2)
    for (int64_t item = 0; item < num_tokens * num_kv_heads; ++item) {
      const int64_t t = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t num_keys = static_cast<int64_t>(pos[t]) + 1, stride = (num_keys + 7) / 8 * 8;
      const int32_t* table = block_tables + static_cast<int64_t>(seq[t]) * max_blocks;
      const auto slot_row = [&](const Cache* cache, int64_t key) {
        const int64_t slot = key_slot(table, key, block_size);
        return cache + slot * kv_row + h * Rows::kRow;
      };
      scores.resize(G * stride);
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < V; ++j)
          _mm256_store_ps(&qf[g][8 * j], _mm256_mul_ps(load8(q + t * q_stride + (h * G + g) * D + 8 * j),
                                                       _mm256_set1_ps(scale)));
      const RowPrefetch<Cache> ahead{k_cache, v_cache, table, block_size, kv_row, h * Rows::kRow,
                                     Rows::kRow * static_cast<int64_t>(sizeof(Cache)),
                                     lone_query(seq, t, num_tokens) ? num_keys : 0};
      // Pass 1: scores, 8 keys at a time (rows past the last key are zeros).
      for (int64_t first = 0; first < num_keys; first += 8) {
        const int n = static_cast<int>(std::min<int64_t>(8, num_keys - first));
        if (first % RowPrefetch<Cache>::kAhead == 0) ahead.pass1(first);
        for (int k = 0; k < 8; ++k) {
          if (k >= n) {
            for (int j = 0; j < V; ++j) _mm256_store_ps(&tile[k][8 * j], _mm256_setzero_ps());
            continue;
          }
          const Cache* kp = slot_row(k_cache, first + k);
          const __m256 key_scale = _mm256_set1_ps(Rows::scale(kp));  // 1 for model-dtype rows
          for (int j = 0; j < V; ++j) {
            const __m256 row = Rows::load(kp + 8 * j);
            _mm256_store_ps(&tile[k][8 * j], Rows::kScaled ? _mm256_mul_ps(row, key_scale) : row);
          }
        }
        for (int g = 0; g < G; ++g) {
          __m256 dots[8];
          for (int k = 0; k < 8; ++k) dots[k] = _mm256_setzero_ps();
          for (int j = 0; j < V; ++j) {
            const __m256 qj = _mm256_load_ps(&qf[g][8 * j]);
            for (int k = 0; k < 8; ++k) dots[k] = _mm256_fmadd_ps(qj, _mm256_load_ps(&tile[k][8 * j]), dots[k]);
          }
          _mm256_storeu_ps(scores.data() + g * stride + first, sum_each8(dots));
        }
      }
      // Softmax numerators exp(s - max) in place (lanes past the last key set to 0); normalization at the end.
      float inv_sum[G];
      for (int g = 0; g < G; ++g) {
        float* sg = scores.data() + g * stride;
        float mx = sg[0];
        for (int64_t key = 1; key < num_keys; ++key) mx = sg[key] > mx ? sg[key] : mx;
        const __m256 max = _mm256_set1_ps(mx);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t key = 0; key < stride; key += 8) {
          __m256 e = nanovllm::exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + key), max));
          if (num_keys - key < 8) {  // the last, partial group: zero the lanes past the last key
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(num_keys - key)), lane);
            e = _mm256_and_ps(e, _mm256_castsi256_ps(valid));
          }
          _mm256_storeu_ps(sg + key, e);
          sum = _mm256_add_ps(sum, e);
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, sum);
        float total = 0.f;
        for (float lane_sum : lanes) total += lane_sum;
        inv_sum[g] = 1.f / total;
      }
      // Each value row located once (pass 2 reads it once per slice), its scale in the weights.
      locate_value_rows<Rows, G>(ahead, slot_row, v_cache, num_keys, stride, value_rows, scores.data());
      // Pass 2: the weighted sum of values, C vectors of each head's row at a time, accumulators in registers.
      for (int c0 = 0; c0 < V; c0 += C) {
        __m256 acc[G][C];
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < C; ++j) acc[g][j] = _mm256_setzero_ps();
        for (int64_t key = 0; key < num_keys; ++key) {
          const Cache* vp = value_rows[key] + 8 * c0;
          __m256 p[G];
          for (int g = 0; g < G; ++g) p[g] = _mm256_broadcast_ss(scores.data() + g * stride + key);
          for (int j = 0; j < C; ++j) {
            const __m256 vv = Rows::load(vp + 8 * j);
            for (int g = 0; g < G; ++g) acc[g][j] = _mm256_fmadd_ps(p[g], vv, acc[g][j]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < C; ++j)
            _mm256_store_ps(result + g * D + 8 * (c0 + j), _mm256_mul_ps(acc[g][j], _mm256_set1_ps(inv_sum[g])));
      }
      for (int g = 0; g < G; ++g) {
        scalar_t* oh = out + (t * num_heads + h * G + g) * D;
        for (int d = 0; d < D; ++d) oh[d] = static_cast<scalar_t>(result[g * D + d]);
      }
    }
  }
}

// Runs the AVX2 path when it has an instantiation for this dtype, head_dim and group size.
template <typename scalar_t>
bool try_attend_avx2(const scalar_t* q, int64_t q_stride, const scalar_t* k_cache, const scalar_t* v_cache,
                     const int32_t* block_tables, int64_t max_blocks, const int32_t* seq, const int32_t* pos,
                     scalar_t* out, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     int64_t block_size, float scale) {
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    return with_head_shape(head_dim, num_heads / num_kv_heads, [&](auto d, auto g) {
      attend_avx2<scalar_t, ModelRows<scalar_t, decltype(d)::value>, decltype(d)::value, decltype(g)::value>(
          q, q_stride, k_cache, v_cache, block_tables, max_blocks, seq, pos, out, num_tokens, num_kv_heads,
          block_size, scale);
    });
  }
  return false;
}
#endif  // __AVX2__ && !__AVX512F__

}  // namespace

// k, v: [N, KVH, D] new rows written at slot_mapping [N] (int64) of k_cache, v_cache [blocks, block_size, KVH,
// D]; then q: [T, H, D] (any T query rows, e.g. the step's decodes) attends: seq, pos [T] int32 index
// block_tables [B, max_blocks] int32. Returns [T, H * D]. q, k and v may be row views of one fused projection
// output (any stride between tokens, each token's heads contiguous): they are read in place, not copied.

namespace {
// t itself if each token's [heads, head_dim] is contiguous (whatever the stride between tokens), else a copy.
at::Tensor rows_in_place(const at::Tensor& t) {
  return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
}

// The layout checks both entry points share (the caches' rows hold head_dim + row_extra elements: 0 for a
// model-dtype cache, the scale's 4 bytes for an 8-bit one); makes q, k, v rows and block_tables contiguous.
void check_paged_layout(at::Tensor& q, at::Tensor& k, at::Tensor& v, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& slot_mapping, at::Tensor& block_tables,
                        const at::Tensor& seq, const at::Tensor& pos, int64_t row_extra) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              row_extra ? "caches must be [blocks, bs, kvh, d + 4]" : "caches must be [blocks, bs, kvh, d]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq.scalar_type() == at::kInt &&
                  pos.scalar_type() == at::kInt,
              "block_tables, seq and pos must be int32");
  q = rows_in_place(q);
  k = rows_in_place(k);
  v = rows_in_place(v);
  block_tables = block_tables.contiguous();
  const int64_t num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(k_cache.size(3) == head_dim + row_extra && k.size(1) == num_kv_heads && k.size(2) == head_dim &&
                  v.size(1) == num_kv_heads && v.size(2) == head_dim,
              row_extra ? "k and v must be [tokens, kv_heads, head_dim], the cache's rows head_dim + 4 bytes"
                        : "k and v must be [tokens, kv_heads, head_dim] of the cache's shape");
  TORCH_CHECK(slot_mapping.size(0) == k.size(0) && v.size(0) == k.size(0),
              "slot_mapping needs one entry per new K/V row");
  TORCH_CHECK(seq.size(0) == q.size(0) && pos.size(0) == q.size(0), "seq and pos need one entry per query row");
}
}  // namespace

at::Tensor paged_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                              at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables,
                              at::Tensor seq, at::Tensor pos, double scale) {
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k.scalar_type() == k_cache.scalar_type() &&
                  v.scalar_type() == k_cache.scalar_type(),
              "q, k, v and the cache must share one dtype");
  check_paged_layout(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq, pos, 0);
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  auto out = at::empty({num_tokens, num_heads * head_dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    write_kv<scalar_t>(k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), slot_mapping.data_ptr<int64_t>(),
                       k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), k.size(0),
                       num_kv_heads * head_dim, k.stride(0), v.stride(0));
#if defined(__AVX512F__)
    if (try_attend_avx512<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(),
                                    v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(),
                                    block_tables.size(1), seq.data_ptr<int32_t>(), pos.data_ptr<int32_t>(),
                                    out.data_ptr<scalar_t>(), num_tokens, num_heads, num_kv_heads, head_dim,
                                    block_size, static_cast<float>(scale)))
      return;
#elif defined(__AVX2__)
    if (try_attend_avx2<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(),
                                  v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(),
                                  block_tables.size(1), seq.data_ptr<int32_t>(), pos.data_ptr<int32_t>(),
                                  out.data_ptr<scalar_t>(), num_tokens, num_heads, num_kv_heads, head_dim,
                                  block_size, static_cast<float>(scale)))
      return;
#endif
    attend<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                     block_tables.data_ptr<int32_t>(), block_tables.size(1), seq.data_ptr<int32_t>(),
                     pos.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), num_tokens, num_heads, num_kv_heads,
                     head_dim, block_size, static_cast<float>(scale));
  });
  return out;
}


// ---- 8-bit caches (kv_cache_dtype=int8 / fp8_e4m3; the layout and arithmetic of nanovllm/attention/kv_quant.py) --
//
// Each cache row (one token's one KV head) is head_dim 8-bit codes followed by the 4 bytes of its float32 scale:
// k_cache, v_cache [blocks, block_size, KVH, D + 4]; int8 codes in a torch.int8 cache, float8_e4m3fn bit patterns
// in a torch.uint8 one (the dtype says the format). A new row is quantized as it is written: scale = max|x| / QMAX
// (127, or 448 for e4m3), codes = x / scale rounded half-to-even (int8) or to e4m3, the same float32 operations
// as the torch reference, so both write the same bytes. Attention is the plain loop of ``attend`` with each key
// and value row decoded to float32 once (for the whole query group); the row's scale multiplies its score and its
// probability instead of every element. That loop is the portable path on every build; the head shapes the
// vectorized kernels know run attend_avx512 over EightBitRows on AVX-512 builds, and attend_avx2 over
// EightBitRows on the avx2 build (their arithmetic on decoded rows).
namespace {

// e4m3 code -> float32, built once from c10's conversion (a table lookup instead of bit fiddling per value).
const float* fp8_e4m3_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i)
      t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

template <KVCodes C>
constexpr float codes_max() { return C == KVCodes::kInt8 ? 127.f : 448.f; }

template <KVCodes C, typename scalar_t>
void quantize_row(const scalar_t* x, int64_t head_dim, uint8_t* row) {
  float amax = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(to_float(x[d])));
  const float scale = amax / codes_max<C>();
  const float divisor = scale > 0.f ? scale : 1.f;  // an all-zero row: codes 0, scale 0
  for (int64_t d = 0; d < head_dim; ++d) {
    const float y = std::min(std::max(to_float(x[d]) / divisor, -codes_max<C>()), codes_max<C>());
    if constexpr (C == KVCodes::kInt8) {
      row[d] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)));  // |y| <= 127: rounding stays in range
    } else {
      row[d] = c10::Float8_e4m3fn(y).x;
    }
  }
  std::memcpy(row + head_dim, &scale, sizeof(float));
}

template <KVCodes C>
inline void decode_row(const uint8_t* row, int64_t head_dim, float* out) {
  if constexpr (C == KVCodes::kInt8) {
    const int8_t* codes = reinterpret_cast<const int8_t*>(row);
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<float>(codes[d]);
  } else {
    const float* table = fp8_e4m3_table();
    for (int64_t d = 0; d < head_dim; ++d) out[d] = table[row[d]];
  }
}

template <KVCodes C, typename scalar_t>
void write_kv_8bit(const scalar_t* k, const scalar_t* v, const int64_t* slots, uint8_t* k_cache, uint8_t* v_cache,
                   int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t k_stride, int64_t v_stride) {
  const int64_t row = head_dim + kScaleBytes;
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      quantize_row<C>(k + t * k_stride + h * head_dim, head_dim, k_cache + (slots[t] * num_kv_heads + h) * row);
      quantize_row<C>(v + t * v_stride + h * head_dim, head_dim, v_cache + (slots[t] * num_kv_heads + h) * row);
    }
  }
}

template <KVCodes C, typename scalar_t>
void attend_8bit(const scalar_t* q, int64_t q_stride, const uint8_t* k_cache, const uint8_t* v_cache,
                 const int32_t* block_tables, int64_t max_blocks, const int32_t* seq, const int32_t* pos, scalar_t* out,
                 int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = head_dim + kScaleBytes;
  const int64_t kv_row = num_kv_heads * row;  // bytes per cache slot
  if constexpr (C == KVCodes::kFp8E4M3) fp8_e4m3_table();  // built before the threads need it
#pragma omp parallel
  {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores, decoded(head_dim);
#pragma omp for schedule(dynamic, 4)
    for (int64_t item = 0; item < num_tokens * num_kv_heads; ++item) {
      const int64_t t = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t num_keys = static_cast<int64_t>(pos[t]) + 1;
      const int32_t* table = block_tables + static_cast<int64_t>(seq[t]) * max_blocks;
      scores.resize(group * num_keys);
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* qh = q + t * q_stride + (h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_float(qh[d]) * scale;
      }
      float* kf = decoded.data();
      // Pass 1: scores of every key for every query head of the group.
      for (int64_t key = 0; key < num_keys; ++key) {
        const int64_t slot = key_slot(table, key, block_size);
        const uint8_t* kp = k_cache + slot * kv_row + h * row;
        decode_row<C>(kp, head_dim, kf);
        const float key_scale = row_scale(kp, head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * kf[d];
          scores[g * num_keys + key] = s * key_scale;
        }
      }
      softmax_rows(scores.data(), group, num_keys);
      // Pass 2: the probability-weighted sum of values, each value row's scale folded into its weight.
      std::fill(acc.begin(), acc.end(), 0.f);
      float* vf = decoded.data();
      for (int64_t key = 0; key < num_keys; ++key) {
        const int64_t slot = key_slot(table, key, block_size);
        const uint8_t* vp = v_cache + slot * kv_row + h * row;
        decode_row<C>(vp, head_dim, vf);
        const float value_scale = row_scale(vp, head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * num_keys + key] * value_scale;
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* oh = out + (t * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) oh[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  }
}

template <KVCodes C, typename scalar_t>
void paged_attention_8bit_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                               const at::Tensor& block_tables, const at::Tensor& seq, const at::Tensor& pos,
                               at::Tensor& out, float scale) {
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  auto* kc = static_cast<uint8_t*>(k_cache.data_ptr());
  auto* vc = static_cast<uint8_t*>(v_cache.data_ptr());
  write_kv_8bit<C, scalar_t>(k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), slot_mapping.data_ptr<int64_t>(), kc, vc,
                             k.size(0), num_kv_heads, head_dim, k.stride(0), v.stride(0));
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    if (with_head_shape(head_dim, num_heads / num_kv_heads, [&](auto d, auto g) {
          using Rows = EightBitRows<C, decltype(d)::value>;
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {  // the bf16 dot-product kernel, codes as bf16
            attend_avx512_bf16<Rows, decltype(d)::value, decltype(g)::value>(
                q.data_ptr<scalar_t>(), q.stride(0), kc, vc, block_tables.data_ptr<int32_t>(), block_tables.size(1),
                seq.data_ptr<int32_t>(), pos.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), num_tokens,
                num_kv_heads, block_size, scale);
            return;
          }
#endif
          attend_avx512<scalar_t, Rows, decltype(d)::value, decltype(g)::value>(
              q.data_ptr<scalar_t>(), q.stride(0), kc, vc, block_tables.data_ptr<int32_t>(), block_tables.size(1),
              seq.data_ptr<int32_t>(), pos.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), num_tokens, num_kv_heads,
              block_size, scale);
        }))
      return;
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    if (with_head_shape(head_dim, num_heads / num_kv_heads, [&](auto d, auto g) {
          attend_avx2<scalar_t, EightBitRows<C, decltype(d)::value>, decltype(d)::value, decltype(g)::value>(
              q.data_ptr<scalar_t>(), q.stride(0), kc, vc, block_tables.data_ptr<int32_t>(), block_tables.size(1),
              seq.data_ptr<int32_t>(), pos.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), num_tokens, num_kv_heads,
              block_size, scale);
        }))
      return;
  }
#endif
  attend_8bit<C, scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), kc, vc, block_tables.data_ptr<int32_t>(),
                           block_tables.size(1), seq.data_ptr<int32_t>(), pos.data_ptr<int32_t>(),
                           out.data_ptr<scalar_t>(), num_tokens, num_heads, num_kv_heads, head_dim, block_size, scale);
}

}  // namespace

// paged_attention over an 8-bit cache: q, k, v in the model dtype ([T, H, D], [N, KVH, D]); k_cache, v_cache
// [blocks, block_size, KVH, D + 4] int8 (kv_cache_dtype=int8) or uint8 (fp8_e4m3). Same arguments and result as
// paged_attention; the new K/V rows are quantized into their slots first.
at::Tensor paged_attention_8bit(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                                   at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables,
                                   at::Tensor seq, at::Tensor pos, double scale) {
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kChar || k_cache.scalar_type() == at::kByte),
              "an 8-bit cache is int8 (kv_cache_dtype=int8) or uint8 (fp8_e4m3)");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "q, k and v must share one dtype");
  check_paged_layout(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq, pos, kScaleBytes);
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  auto out = at::empty({num_tokens, num_heads * head_dim}, q.options());
  const bool int8 = k_cache.scalar_type() == at::kChar;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_8bit", [&] {
    if (int8)
      paged_attention_8bit_impl<KVCodes::kInt8, scalar_t>(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq,
                                                          pos, out, static_cast<float>(scale));
    else
      paged_attention_8bit_impl<KVCodes::kFp8E4M3, scalar_t>(q, k, v, k_cache, v_cache, slot_mapping, block_tables,
                                                             seq, pos, out, static_cast<float>(scale));
  });
  return out;
}
