// Per-thread scratch tensors for a kernel's temporaries (an int8 linear's activation codes, scales and sums).
//
// A quantized linear used to allocate four or five such tensors per call through torch's allocator. Over a step's
// 121 int8 linears those allocations were most of the activation quantizer's time at batch 1 and a large share
// at 32 rows (experiments/ab_quant_gemm.py; the measurement is in experiments/results/history_quantization.md). Here
// each calling thread keeps one growing byte buffer per slot and hands out tensors over it, without allocating.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

namespace nanovllm {

// Distinct slots for the temporaries one kernel call holds at once (kCodes2: a second set of codes, the AVX2 int8
// layers' nibbles or AMX's second digit). Kernels never nest, so every call reuses them.
enum class Scratch : int { kCodes, kCodes2, kScales, kSums, kCodeSums, kCount };

// A tensor of `sizes` and `dtype` over this thread's buffer for `slot`, its contents undefined (as at::empty's).
// It stays valid until this thread asks for the same slot again: a kernel takes its temporaries at the start of a
// call and is done with them when it returns. The buffer grows to the largest request and lives as long as the
// thread (a prefill's activation codes: rows x K bytes). The last few shapes' tensors are kept too: a decode step
// asks for the same handful again and again (rows x hidden, rows x intermediate), and making even a view costs
// about what the allocation did.
inline at::Tensor thread_scratch(Scratch slot, at::IntArrayRef sizes, at::ScalarType dtype) {
  struct View {
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
    at::Tensor tensor;
  };
  struct Slot {
    at::Tensor buffer;
    std::array<View, 4> views;  // the latest shapes, by turns
    size_t next = 0;
  };
  thread_local std::array<Slot, static_cast<size_t>(Scratch::kCount)> slots;
  Slot& s = slots[static_cast<size_t>(slot)];
  for (const View& view : s.views)
    if (view.tensor.defined() && view.dtype == dtype && sizes.equals(view.sizes)) return view.tensor;
  int64_t numel = 1;
  for (const int64_t size : sizes) numel *= size;
  const int64_t bytes = std::max<int64_t>(numel, 1) * static_cast<int64_t>(c10::elementSize(dtype));
  if (!s.buffer.defined() || s.buffer.numel() < bytes) {
    s.views = {};  // views of the buffer being replaced (it is freed once nothing holds it)
    // Whole 64-byte lines, so that any dtype's view of the buffer divides it.
    s.buffer = at::empty({(bytes + 63) / 64 * 64}, at::TensorOptions().dtype(at::kByte));
  }
  // torch's CPU allocator aligns every buffer to 64 bytes, enough for any dtype. The view shares the buffer's
  // storage, so it keeps the buffer alive for as long as anything holds it.
  View& view = s.views[s.next];
  s.next = (s.next + 1) % s.views.size();
  view = {sizes.vec(), dtype, s.buffer.view(dtype).narrow(0, 0, numel).view(sizes)};
  return view.tensor;
}

}  // namespace nanovllm
