// Copying K/V blocks into the paged pool: every (layer, K/V) slab of every run of one load in one call.
//
// A load from a KV tier writes, per run of consecutive pool blocks, 2 x layers slabs of a few KB each, scattered
// over the pool [layers, 2, num_blocks, *block]. memcpy stores pieces this small through the caches (it streams
// only copies of the order of the last-level cache): each destination line is brought into the cache before it
// is written, traffic for nothing, since the load overwrites whole lines. This copy stores with non-temporal
// (streaming) stores, which write whole lines without reading them, and copies several pieces side by side, a
// chunk of each in turn, with the source prefetched ahead in each: the hardware prefetchers then follow several
// streams at once, so more of the memory's latency overlaps than one piece after another allows. Bytes are
// copied as they are: any dtype.
//
// The vector width is the build's (nanovllm/kernels.py builds one per ISA level): AVX-512 stores 64 bytes, AVX
// 32, SSE2 (every x86-64) 16; another architecture copies with memcpy. kv_copy_isa() names the path.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

struct Piece {
  char* dst;
  const char* src;
  int64_t bytes;
};

#if defined(__AVX512F__)
constexpr int64_t kVec = 64;
inline void stream_vec(char* dst, const char* src) {
  _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), _mm512_loadu_si512(reinterpret_cast<const void*>(src)));
}
#elif defined(__AVX__)
constexpr int64_t kVec = 32;
inline void stream_vec(char* dst, const char* src) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}
#elif defined(__SSE2__)
constexpr int64_t kVec = 16;
inline void stream_vec(char* dst, const char* src) {
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}
#endif

#if defined(__SSE2__)
constexpr int64_t kLine = 64;
constexpr int64_t kStreams = 8;          // pieces copied side by side, a chunk of each in turn
constexpr int64_t kChunk = 256;          // bytes of one piece per turn
constexpr int64_t kPrefetchBytes = 1024; // bytes of each piece's source prefetched ahead of its copy

// Copies ``pieces[0:count]`` (at most kStreams) interleaved, kChunk bytes of each in turn: the hardware
// prefetchers follow several streams at once, so more of the memory's latency overlaps than piece by piece.
void copy_interleaved(const Piece* pieces, int64_t count) {
  char* dst[kStreams];
  const char* src[kStreams];
  int64_t body[kStreams];
  int64_t longest = 0;
  for (int64_t s = 0; s < count; ++s) {
    const Piece& p = pieces[s];
    // An unaligned head goes through ordinary stores, up to the destination's next line boundary; the tail
    // (less than a line) too.
    int64_t head = (kLine - static_cast<int64_t>(reinterpret_cast<uintptr_t>(p.dst) % kLine)) % kLine;
    head = std::min(head, p.bytes);
    if (head) std::memcpy(p.dst, p.src, head);
    dst[s] = p.dst + head;
    src[s] = p.src + head;
    body[s] = (p.bytes - head) / kLine * kLine;
    if (p.bytes - head > body[s]) std::memcpy(dst[s] + body[s], src[s] + body[s], p.bytes - head - body[s]);
    longest = std::max(longest, body[s]);
  }
  for (int64_t s = 0; s < count; ++s)
    for (int64_t b = 0; b < std::min(kPrefetchBytes, body[s]); b += kLine) _mm_prefetch(src[s] + b, _MM_HINT_T0);
  for (int64_t off = 0; off < longest; off += kChunk) {
    for (int64_t s = 0; s < count; ++s) {
      const int64_t end = std::min(off + kChunk, body[s]);
      for (int64_t i = off; i < end; i += kLine) {
        if (i + kPrefetchBytes < body[s]) _mm_prefetch(src[s] + i + kPrefetchBytes, _MM_HINT_T0);
        for (int64_t v = 0; v < kLine; v += kVec) stream_vec(dst[s] + i + v, src[s] + i + v);
      }
    }
  }
}
#endif

void copy_pieces(const std::vector<Piece>& pieces) {
#if defined(__SSE2__)
  const int64_t n = static_cast<int64_t>(pieces.size());
  for (int64_t i = 0; i < n; i += kStreams) copy_interleaved(pieces.data() + i, std::min(kStreams, n - i));
  _mm_sfence();  // streaming stores are weakly ordered: make them visible before returning
#else
  for (const Piece& p : pieces) std::memcpy(p.dst, p.src, p.bytes);
#endif
}

}  // namespace

std::string kv_copy_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX__)
  return "avx2";
#elif defined(__SSE2__)
  return "sse2";
#else
  return "memcpy";
#endif
}

// pool [layers, 2, num_blocks, *block] and src [layers, 2, n, *block] of the same element size, each with its
// block dims (3:) contiguous (the first three dims may have any strides: src may be a view of a tier's slab).
// runs [R, 4] int64: (first source block, first pool block, count, descending). An ascending run copies source
// blocks j .. j+count-1 to pool blocks low .. low+count-1; a descending one the same source blocks in reverse,
// pool block low+k getting source block j+count-1-k.
void copy_kv_blocks(at::Tensor pool, at::Tensor src, at::Tensor runs) {
  TORCH_CHECK(pool.device().is_cpu() && src.device().is_cpu(), "copy_kv_blocks: CPU tensors only");
  TORCH_CHECK(pool.dim() >= 3 && src.dim() == pool.dim(), "copy_kv_blocks: pool and src must be [layers, 2, blocks, ...]");
  TORCH_CHECK(pool.element_size() == src.element_size(), "copy_kv_blocks: pool and src differ in element size");
  TORCH_CHECK(pool.size(0) == src.size(0) && pool.size(1) == src.size(1), "copy_kv_blocks: layers or K/V differ");
  int64_t block_elems = 1;
  for (int64_t d = pool.dim() - 1; d >= 3; --d) {
    TORCH_CHECK(pool.size(d) == src.size(d), "copy_kv_blocks: block shapes differ");
    TORCH_CHECK(pool.size(d) == 1 || (pool.stride(d) == block_elems && src.stride(d) == block_elems),
                "copy_kv_blocks: a block must be contiguous in pool and src");
    block_elems *= pool.size(d);
  }
  TORCH_CHECK(runs.dtype() == at::kLong && runs.dim() == 2 && runs.size(1) == 4 && runs.is_contiguous(),
              "copy_kv_blocks: runs must be a contiguous int64 [R, 4]");
  const int64_t es = pool.element_size();
  const int64_t block_bytes = block_elems * es;
  const int64_t layers = pool.size(0), halves = pool.size(1);
  const int64_t ps0 = pool.stride(0) * es, ps1 = pool.stride(1) * es, ps2 = pool.stride(2) * es;
  const int64_t ss0 = src.stride(0) * es, ss1 = src.stride(1) * es, ss2 = src.stride(2) * es;
  const bool whole_runs = ps2 == block_bytes && ss2 == block_bytes;  // a run's blocks lie side by side on both
  char* pool_base = static_cast<char*>(pool.data_ptr());
  const char* src_base = static_cast<const char*>(src.data_ptr());
  const int64_t* r = runs.data_ptr<int64_t>();
  std::vector<Piece> pieces;
  for (int64_t i = 0; i < runs.size(0); ++i) {
    const int64_t j = r[4 * i], low = r[4 * i + 1], count = r[4 * i + 2];
    const bool down = r[4 * i + 3] != 0;
    TORCH_CHECK(count >= 1 && j >= 0 && j + count <= src.size(2) && low >= 0 && low + count <= pool.size(2),
                "copy_kv_blocks: run ", i, " is out of range");
    for (int64_t l = 0; l < layers; ++l) {
      for (int64_t h = 0; h < halves; ++h) {
        char* dst = pool_base + l * ps0 + h * ps1 + low * ps2;
        const char* from = src_base + l * ss0 + h * ss1 + j * ss2;
        if (!down && whole_runs) {
          pieces.push_back({dst, from, count * block_bytes});
          continue;
        }
        for (int64_t k = 0; k < count; ++k)
          pieces.push_back({dst + k * ps2, from + (down ? count - 1 - k : k) * ss2, block_bytes});
      }
    }
  }
  copy_pieces(pieces);
}
