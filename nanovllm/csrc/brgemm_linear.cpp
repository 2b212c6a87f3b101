// y = x W^T (+ b) through oneDNN's batch-reduce GEMM micro-kernel (brgemm), as torch exports it
// (at::native::cpublas::brgemm): AMX tiles for bfloat16 on CPUs with AMX-BF16, AVX-512 / AVX2 FMA for float32.
//
// Why not oneDNN's prepacked linear (torch.ops.mkldnn._linear_pointwise)? At the row counts of decoding (1 to a
// few dozen rows) a linear is bound by reading its weight once, and that primitive reads it more slowly than
// this loop does (experiments/bench_linears.py: SmolLM2-135M's linear shapes, distinct weights per layer so
// nothing stays in cache; docs/speed.md has the measurement and its machine). The loop is the simplest one that
// reads each weight byte once per block of rows:
//   - the weight is stored once, at load time, in blocks of BLOCK_N = 32 output features, each block K x 32 in
//     the layout the micro-kernel reads (VNNI pairs for bf16, plain rows for float32);
//   - threads split the output-feature blocks (then the row blocks); for each, one brgemm call multiplies up to
//     BLOCK_M rows of x by the whole K x 32 block into a float32 tile, then the epilogue adds the bias and
//     rounds to the output dtype;
//   - BLOCK_M = 256 rows: up to it, the weight is read exactly once per call; the float32 tile (32 KB) and the
//     rows of x in flight stay in each core's L2.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/native/CPUBlas.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t BLOCK_N = 32;
constexpr int64_t BLOCK_M = 256;
constexpr int64_t ROW_STEP = 16;   // row counts the micro-kernel is compiled for: multiples of it, and 1 to 15

// One row of a float32 tile into the output row: + bias, rounded to bf16 (round-to-nearest-even, as torch).
inline void store_row(const float* tile, const float* bias, c10::BFloat16* out, int64_t count) {
  int64_t j = 0;
#if defined(__AVX512BF16__)
  for (; j + 16 <= count; j += 16) {
    __m512 v = _mm512_loadu_ps(tile + j);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
#endif
  for (; j < count; ++j) out[j] = c10::BFloat16(tile[j] + (bias != nullptr ? bias[j] : 0.0f));
}

inline void store_row(const float* tile, const float* bias, float* out, int64_t count) {
  for (int64_t j = 0; j < count; ++j) out[j] = tile[j] + (bias != nullptr ? bias[j] : 0.0f);
}

template <typename T>
void brgemm_rows(const T* x, const T* packed, const float* bias, T* y, int64_t m, int64_t n, int64_t k) {
  constexpr bool vnni = std::is_same_v<T, c10::BFloat16>;
  const int64_t n_blocks = (n + BLOCK_N - 1) / BLOCK_N, m_blocks = (m + BLOCK_M - 1) / BLOCK_M;
#pragma omp parallel
  {
    std::vector<float> tile(std::min(m, BLOCK_M) * BLOCK_N);
#pragma omp for collapse(2) schedule(static)
    for (int64_t nb = 0; nb < n_blocks; ++nb) {
      for (int64_t mb = 0; mb < m_blocks; ++mb) {
        const int64_t row0 = mb * BLOCK_M, rows = std::min(BLOCK_M, m - row0);
        const int64_t col0 = nb * BLOCK_N, cols = std::min(BLOCK_N, n - col0);
        // torch caches one JIT-compiled micro-kernel per row count, per thread, without bound (each takes
        // hundreds of KB of code buffer), so a server seeing every row count up to BLOCK_M would hold hundreds
        // of them. A multiple of ROW_STEP rows and the remainder, in at most two calls, bound the kernels to
        // BLOCK_M / ROW_STEP + ROW_STEP - 1 per shape; fewer rows than ROW_STEP (decoding) stay one call.
        const int64_t bulk = rows / ROW_STEP * ROW_STEP;
        if (bulk > 0)
          at::native::cpublas::brgemm(bulk, BLOCK_N, k, k, BLOCK_N, BLOCK_N, false, x + row0 * k,
                                      packed + nb * k * BLOCK_N, tile.data(), vnni);
        if (rows > bulk)
          at::native::cpublas::brgemm(rows - bulk, BLOCK_N, k, k, BLOCK_N, BLOCK_N, false, x + (row0 + bulk) * k,
                                      packed + nb * k * BLOCK_N, tile.data() + bulk * BLOCK_N, vnni);
        for (int64_t i = 0; i < rows; ++i)
          store_row(tile.data() + i * BLOCK_N, bias == nullptr ? nullptr : bias + col0, y + (row0 + i) * n + col0,
                    cols);
      }
    }
    // Each thread hands back the micro-kernel's hardware state (AMX tile configuration) it set up.
    at::native::cpublas::brgemm_release(vnni);
  }
}

}  // namespace

// Whether a ONEDNN_MAX_CPU_ISA cap (NANOVLLM_CPU_ISA sets one: nanovllm.machine.apply_isa_cap) keeps oneDNN
// below AVX-512 BF16. A CPU that has it, capped lower, gets no bf16 brgemm from oneDNN either.
static bool onednn_capped_below_bf16() {
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (cap == nullptr || *cap == '\0') return false;
  static const char* const kBelow[] = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                                       "AVX512_CORE_VNNI"};
  for (const char* below : kBelow)
    if (std::strcmp(cap, below) == 0) return true;
  return false;
}

// Whether oneDNN's brgemm runs bfloat16 here: it needs AMX or AVX-512 BF16, not capped away. Elsewhere (AVX2,
// AVX-512 without BF16, or a cap below it) torch's brgemm aborts the process instead of raising, so the bf16
// calls below refuse first; the fast path takes another kernel there (fast_path.linear_kernel).
bool brgemm_bf16_available() {
  if (onednn_capped_below_bf16()) return false;
#if defined(__x86_64__) || defined(__i386__)
  return at::native::cpublas::could_pack(at::kBFloat16) || __builtin_cpu_supports("avx512bf16");
#else
  return at::native::cpublas::could_pack(at::kBFloat16);
#endif
}

// The weight [N, K] in the micro-kernel's layout: [ceil(N / 32), K * 32], zero-padded to whole blocks. Called
// once per linear at load time.
at::Tensor pack_brgemm_weight(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "pack_brgemm_weight: weight must be a 2-D CPU tensor");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "pack_brgemm_weight: weight must be bfloat16 or float32");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(dtype != at::kBFloat16 || k % 2 == 0, "pack_brgemm_weight: bfloat16 needs an even in_features, got ", k);
  TORCH_CHECK(dtype != at::kBFloat16 || brgemm_bf16_available(),
              "pack_brgemm_weight: bfloat16 brgemm needs AMX or AVX-512 BF16, which this CPU lacks "
              "or NANOVLLM_CPU_ISA caps below");
  const int64_t n_blocks = (n + BLOCK_N - 1) / BLOCK_N;
  auto padded = at::zeros({n_blocks * BLOCK_N, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // [n_blocks, K, 32]: each block's K x 32 slice of W^T, row-major.
  auto blocks = padded.view({n_blocks, BLOCK_N, k}).transpose(1, 2).contiguous();
  if (dtype == at::kFloat) return blocks.view({n_blocks, k * BLOCK_N});
  // Without AMX, torch's pack refuses bf16 ("no need to pack"), and its brgemm still reads B as VNNI pairs
  // (K/2 rows of [32 features][2 consecutive K]): that layout, made here.
  if (!at::native::cpublas::could_pack(dtype))
    return blocks.view({n_blocks, k / 2, 2, BLOCK_N}).transpose(2, 3).contiguous().view({n_blocks, k * BLOCK_N});
  auto packed = at::empty({n_blocks, k * BLOCK_N}, weight.options());
  for (int64_t b = 0; b < n_blocks; ++b)
    at::native::cpublas::pack(k, BLOCK_N, BLOCK_N, BLOCK_N, dtype, dtype, blocks[b].data_ptr(), packed[b].data_ptr());
  return packed;
}

// x [M, K] times the packed weight of ``out_features`` outputs (+ bias), in x's dtype.
at::Tensor brgemm_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias,
                            int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "brgemm_linear: x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "brgemm_linear: x and the packed weight differ in dtype");
  TORCH_CHECK(x.scalar_type() != at::kBFloat16 || brgemm_bf16_available(),
              "brgemm_linear: bfloat16 brgemm needs AMX or AVX-512 BF16, which this CPU lacks or "
              "NANOVLLM_CPU_ISA caps below");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.size(1) == k * BLOCK_N && packed.size(0) * BLOCK_N >= out_features,
              "brgemm_linear: the packed weight does not match x's in_features or out_features");
  auto xc = x.contiguous();
  auto y = at::empty({m, out_features}, x.options());
  if (m == 0) return y;
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  const float* bias_p = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kBFloat16) {
    brgemm_rows(xc.data_ptr<c10::BFloat16>(), packed.data_ptr<c10::BFloat16>(), bias_p, y.data_ptr<c10::BFloat16>(),
                m, out_features, k);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "brgemm_linear: x must be bfloat16 or float32");
    brgemm_rows(xc.data_ptr<float>(), packed.data_ptr<float>(), bias_p, y.data_ptr<float>(), m, out_features, k);
  }
  return y;
}

// A torch operator too, so profiles (and torch.compile) see it as one call, as the other linears.
TORCH_LIBRARY_FRAGMENT(NANOVLLM_OPS, m) {
  m.def("brgemm_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(NANOVLLM_OPS, CPU, m) { m.impl("brgemm_linear", &brgemm_linear); }
