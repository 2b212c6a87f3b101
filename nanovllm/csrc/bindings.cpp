// The Python module of nano-vllm's CPU kernels (built by nanovllm/kernels.py).
#include "kernels.h"

#include <torch/python.h>

void bind_decoder_stack(pybind11::module& m);  // decoder_stack.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Write new K/V into the paged cache, then attend (CPU)");
  m.def("paged_attention_8bit", &paged_attention_8bit, "paged_attention over an int8 / fp8_e4m3 cache (CPU)");
  m.def("rms_norm", &rms_norm, "transformers-style RMSNorm in one pass (CPU)");
  m.def("add_rms_norm_", &add_rms_norm_, "In place residual += delta, then RMSNorm of it, in one pass (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [gate | up] row block (CPU)");
  m.def("rotary_", &rotary_, "In-place rotary embedding of q and k (CPU)");
  m.def("gemv_available", &gemv_available, "Whether gemv_bf16 was built (AVX-512 BF16 CPUs)");
  m.def("gemv_bf16", &gemv_bf16, "x W^T + b for a few bfloat16 rows, bound by reading W once (CPU)");
  m.def("quant_linear", &quant_linear, "x W^T + b over int8 / GGUF Q8_0 / Q4 weights, x quantized to int8 (CPU)");
  m.def("quant_gemm_isa", &quant_gemm_isa, "The vector path of this build's quantized GEMM (avx512_vnni, avx2 or scalar)");
  m.def("q4x16_available", &q4x16_available, "Whether q4x16_linear was built (the avx2, avx512 and avx512_bf16 builds)");
  m.def("i8x16_available", &i8x16_available, "Whether i8x16_linear was built (the avx2, avx512 and avx512_bf16 builds)");
  m.def("q8x16_available", &q8x16_available, "Whether q8x16_linear was built (the avx2 and avx512 builds)");
  m.def("q8x16_linear", &q8x16_linear, "x W^T + b over GGUF Q8_0 blocks interleaved by 16 features, x int8 per 32 values (CPU)");
  m.def("q4x16_linear", &q4x16_linear, "x W^T + b over Q4 blocks interleaved by 16 features, x int8 per 32 values (CPU)");
  m.def("i8x16_linear", &i8x16_linear, "x W^T + b over int8 weights interleaved by 16 features, x int8 per 32 values (CPU)");
  m.def("int8_amx_available", &int8_amx_available, "Whether int8_amx_linear runs here (AMX-INT8 CPU, OS, build)");
  m.def("pack_int8_amx", &pack_int8_amx, "int8 weight codes in the AMX tiles' layout, as unsigned w + 128 (CPU)");
  m.def("int8_amx_linear", &int8_amx_linear, pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scales"),
        pybind11::arg("bias"), pybind11::arg("out_features"), pybind11::arg("digits") = 2,
        "x W^T + b over int8 weights on AMX-INT8 tiles, x int8 per token in 1 or 2 digits (CPU)");
  m.def("brgemm_bf16_available", &brgemm_bf16_available, "Whether brgemm runs bfloat16 on this CPU (AMX or AVX-512 BF16)");
  m.def("pack_brgemm_weight", &pack_brgemm_weight, "A linear's weight in oneDNN brgemm's blocked layout (CPU)");
  m.def("brgemm_linear", &brgemm_linear, "x W^T + b through oneDNN's brgemm micro-kernel, AMX for bf16 (CPU)");
  m.def("bf16_fma_available", &bf16_fma_available, "Whether bf16_fma_linear was built (every build with AVX2)");
  m.def("pack_bf16_fma_weight", &pack_bf16_fma_weight, "A bf16 linear's weight in bf16_fma_linear's layout (CPU)");
  m.def("bf16_fma_linear", &bf16_fma_linear, "x W^T + b in bf16 with float32 FMAs, for CPUs without bf16 arithmetic");
  bind_decoder_stack(m);
  m.def("kv_copy_isa", &kv_copy_isa, "The store path of this build's copy_kv_blocks (avx512, avx2, sse2 or memcpy)");
  m.def("copy_kv_blocks", &copy_kv_blocks, "Runs of K/V blocks into the paged pool in one call, with streaming stores (CPU)");
  m.def("greedy_sample", &greedy_sample, "Per-row argmax and NaN/+inf flag of logits in one read (CPU)");
}
