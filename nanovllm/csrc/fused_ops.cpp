// Fused element-wise ops of the fast path: each replaces a chain of small torch ops (and their dtype round
// trips) by one pass over the rows. Math in float32, one rounding to the storage dtype at the end.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace {

// AVX-512 is used for float32 and bfloat16 (where the CPU has AVX-512 BF16 for the rounding); 16 lanes at a
// time, the same roundings as the scalar loops, which take the tails and the other dtypes.
template <typename scalar_t>
constexpr bool kVectorized =
#if defined(__AVX512BF16__)
    std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;
#elif defined(__AVX512F__)
    std::is_same_v<scalar_t, float>;
#else
    false;
#endif

// outr = weight * (xr * inv), the normalized value rounded to the storage dtype before the weight, as
// transformers' LlamaRMSNorm does.
template <typename scalar_t>
inline void scale_row(const scalar_t* xr, const scalar_t* weight, scalar_t* outr, int64_t dim, float inv) {
  int64_t d = 0;
#if defined(__AVX512F__)
  if constexpr (kVectorized<scalar_t>) {
    const __m512 inv16 = _mm512_set1_ps(inv);
    for (; d + 16 <= dim; d += 16) {
      const __m512 normed =
          nanovllm::round16(_mm512_mul_ps(nanovllm::load16(xr + d), inv16), static_cast<scalar_t*>(nullptr));
      nanovllm::store16(outr + d, _mm512_mul_ps(nanovllm::load16(weight + d), normed));
    }
  }
#endif
  for (; d < dim; ++d) {
    const scalar_t normed = static_cast<scalar_t>(static_cast<float>(xr[d]) * inv);
    outr[d] = static_cast<scalar_t>(static_cast<float>(weight[d]) * static_cast<float>(normed));
  }
}

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t rows, int64_t dim,
                   float eps) {
#pragma omp parallel for if (rows > 16)
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* xr = x + r * dim;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < dim; ++d) sum += static_cast<float>(xr[d]) * static_cast<float>(xr[d]);
    scale_row(xr, weight, out + r * dim, dim, 1.f / std::sqrt(sum / dim + eps));
  }
}

template <typename scalar_t>
void rotary_rows(scalar_t* x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_stride,
                 int64_t dim, const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + t * dim;
    const float* s = sin + t * dim;
    for (int64_t h = 0; h < heads; ++h) {
      scalar_t* v = x + t * token_stride + h * head_stride;
      for (int64_t d = 0; d < half; ++d) {
        const float a = static_cast<float>(v[d]), b = static_cast<float>(v[d + half]);
        v[d] = static_cast<scalar_t>(a * c[d] - b * s[d]);
        v[d + half] = static_cast<scalar_t>(b * c[d + half] + a * s[d + half]);
      }
    }
  }
}

// residual[r] += delta[r] (rounded to the storage dtype, as torch's add is), then out[r] = rmsnorm(residual[r]).
template <typename scalar_t>
void add_rms_norm_rows(scalar_t* residual, const scalar_t* delta, const scalar_t* weight, scalar_t* out,
                       int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows > 16)
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* xr = residual + r * dim;
    const scalar_t* dr = delta + r * dim;
    float sum = 0.f;
    int64_t d = 0;
#if defined(__AVX512F__)
    if constexpr (kVectorized<scalar_t>) {
      __m512 acc = _mm512_setzero_ps();
      for (; d + 16 <= dim; d += 16) {
        const __m512 summed = nanovllm::round16(
            _mm512_add_ps(nanovllm::load16(xr + d), nanovllm::load16(dr + d)), static_cast<scalar_t*>(nullptr));
        nanovllm::store16(xr + d, summed);
        acc = _mm512_fmadd_ps(summed, summed, acc);
      }
      sum = _mm512_reduce_add_ps(acc);
    }
#endif
    for (; d < dim; ++d) {
      const scalar_t summed = static_cast<scalar_t>(static_cast<float>(xr[d]) + static_cast<float>(dr[d]));
      xr[d] = summed;
      sum += static_cast<float>(summed) * static_cast<float>(summed);
    }
    scale_row(xr, weight, out + r * dim, dim, 1.f / std::sqrt(sum / dim + eps));
  }
}

// out[r] = silu(gate[r]) * up[r] for gate_up[r] = [gate | up]; silu rounded to the storage dtype before the
// product, as F.silu(gate) * up rounds it.
template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* gate_up, scalar_t* out, int64_t rows, int64_t width) {
#pragma omp parallel for if (rows > 16)
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* gate = gate_up + r * 2 * width;
    const scalar_t* up = gate + width;
    scalar_t* outr = out + r * width;
    int64_t d = 0;
#if defined(__AVX512F__)
    if constexpr (kVectorized<scalar_t>) {
      const __m512 one = _mm512_set1_ps(1.f);
      for (; d + 16 <= width; d += 16) {
        const __m512 g = nanovllm::load16(gate + d);
        const __m512 silu = nanovllm::round16(
            _mm512_div_ps(g, _mm512_add_ps(one, nanovllm::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))),
            static_cast<scalar_t*>(nullptr));
        nanovllm::store16(outr + d, _mm512_mul_ps(silu, nanovllm::load16(up + d)));
      }
    }
#endif
    for (; d < width; ++d) {
      const float g = static_cast<float>(gate[d]);
      const scalar_t silu = static_cast<scalar_t>(g / (1.f + std::exp(-g)));
      outr[d] = static_cast<scalar_t>(static_cast<float>(silu) * static_cast<float>(up[d]));
    }
  }
}

}  // namespace

// In place on residual [rows, dim] (contiguous): residual += delta; returns weight * rmsnorm(residual). The
// decoder layer's residual add and the following RMSNorm in one pass (vLLM's fused_add_rms_norm).
at::Tensor add_rms_norm_(at::Tensor residual, at::Tensor delta, at::Tensor weight, double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && delta.sizes() == residual.sizes() &&
                  weight.dim() == 1 && weight.size(0) == residual.size(1),
              "add_rms_norm_: residual [rows, dim] contiguous, delta [rows, dim], weight [dim]");
  TORCH_CHECK(residual.scalar_type() == delta.scalar_type() && residual.scalar_type() == weight.scalar_type(),
              "add_rms_norm_: residual, delta and weight must share a dtype");
  delta = delta.contiguous();
  auto out = at::empty_like(residual);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm_", [&] {
    add_rms_norm_rows<scalar_t>(residual.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(),
                                weight.contiguous().data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                residual.size(0), residual.size(1), static_cast<float>(eps));
  });
  return out;
}

// gate_up: [rows, 2 * width] (the fused gate/up projection's output). Returns silu(gate) * up, [rows, width].
at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up must be [rows, 2 * width]");
  gate_up = gate_up.contiguous();
  const int64_t width = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), width}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), width);
  });
  return out;
}

// x: [rows, dim] contiguous; weight: [dim]. Returns weight * rmsnorm(x) like transformers' LlamaRMSNorm.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && x.size(1) == weight.size(0), "rms_norm: x [rows, dim], weight [dim]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
  x = x.contiguous();
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.contiguous().data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// In place: rotate q [T, Hq, D] and k [T, Hk, D] (views whose last dim is contiguous, e.g. slices of a fused
// qkv output) by the per-token cos/sin rows [T, D] (float32), in transformers' rotate_half convention.
void rotary_(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1,
              "rotary_: q and k must be [tokens, heads, head_dim] with a contiguous last dim");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(0) == q.size(0) && cos.size(1) == q.size(2),
              "rotary_: cos and sin must be contiguous float32 [tokens, head_dim]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rotary_: q and k must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_", [&] {
    rotary_rows<scalar_t>(q.data_ptr<scalar_t>(), q.size(0), q.size(1), q.stride(0), q.stride(1), q.size(2),
                          cos.data_ptr<float>(), sin.data_ptr<float>());
    rotary_rows<scalar_t>(k.data_ptr<scalar_t>(), k.size(0), k.size(1), k.stride(0), k.stride(1), k.size(2),
                          cos.data_ptr<float>(), sin.data_ptr<float>());
  });
}
