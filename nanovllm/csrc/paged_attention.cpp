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
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  // The bit pattern of a bfloat16 is the upper half of the float32: shift, don't call a conversion routine,
  // so the compiler vectorizes the loops below.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename scalar_t>
void write_kv(const scalar_t* k, const scalar_t* v, const int64_t* slots, scalar_t* k_cache, scalar_t* v_cache,
              int64_t num_tokens, int64_t row) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::memcpy(k_cache + slots[t] * row, k + t * row, row * sizeof(scalar_t));
    std::memcpy(v_cache + slots[t] * row, v + t * row, row * sizeof(scalar_t));
  }
}

template <typename scalar_t>
void attend(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* block_tables,
            int64_t max_blocks, const int32_t* seq, const int32_t* pos, scalar_t* out, int64_t num_tokens,
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
        const scalar_t* qh = q + (t * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_float(qh[d]) * scale;
      }
      // Pass 1: scores of every key for every query head of the group.
      for (int64_t key = 0; key < num_keys; ++key) {
        const int64_t slot = static_cast<int64_t>(table[key / block_size]) * block_size + key % block_size;
        const scalar_t* kp = k_cache + slot * kv_row + h * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * to_float(kp[d]);
          scores[g * num_keys + key] = s;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * num_keys;
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
      // Pass 2: the probability-weighted sum of values.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t key = 0; key < num_keys; ++key) {
        const int64_t slot = static_cast<int64_t>(table[key / block_size]) * block_size + key % block_size;
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

}  // namespace

// k, v: [N, KVH, D] new rows written at slot_mapping [N] (int64) of k_cache, v_cache [blocks, block_size, KVH,
// D]; then q: [T, H, D] (any T query rows, e.g. the step's decodes) attends: seq, pos [T] int32 index
// block_tables [B, max_blocks] int32. Returns [T, H * D].
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                              torch::Tensor v_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
                              torch::Tensor seq, torch::Tensor pos, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must be [blocks, bs, kvh, d]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k.scalar_type() == k_cache.scalar_type() &&
                  v.scalar_type() == k_cache.scalar_type(),
              "q, k, v and the cache must share one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "slot_mapping must be int64");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq.scalar_type() == torch::kInt32 &&
                  pos.scalar_type() == torch::kInt32,
              "block_tables, seq and pos must be int32");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  block_tables = block_tables.contiguous();
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(slot_mapping.size(0) == k.size(0) && v.size(0) == k.size(0),
              "slot_mapping needs one entry per new K/V row");
  TORCH_CHECK(seq.size(0) == num_tokens && pos.size(0) == num_tokens, "seq and pos need one entry per query row");
  auto out = torch::empty({num_tokens, num_heads * head_dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    write_kv<scalar_t>(k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), slot_mapping.data_ptr<int64_t>(),
                       k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), k.size(0),
                       num_kv_heads * head_dim);
    attend<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                     block_tables.data_ptr<int32_t>(), block_tables.size(1), seq.data_ptr<int32_t>(),
                     pos.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), num_tokens, num_heads, num_kv_heads,
                     head_dim, block_size, static_cast<float>(scale));
  });
  return out;
}
