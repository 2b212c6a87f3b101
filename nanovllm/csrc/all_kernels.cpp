// Every kernel source in one translation unit (a "unity" build), the only file the extension compiles.
//
// Why: each source includes the torch headers (ATen, torch/library.h), which take the compiler longer to parse
// than most of the kernels take to compile; eleven units parsed them eleven times per build, and a machine
// builds one module per ISA level it runs (four on an AVX-512 CPU). Included here, they are parsed once
// (docs/running.md has the build times). The sources stay separate files, each readable on its own; what they
// declare at file scope must therefore have distinct names across files (their anonymous namespaces are one
// namespace here).
#include "paged_attention.cpp"
#include "fused_ops.cpp"
#include "sampling.cpp"
#include "gemv.cpp"
#include "quant_gemm.cpp"
#include "int8_amx.cpp"
#include "brgemm_linear.cpp"
#include "bf16_fma_linear.cpp"
#include "decoder_stack.cpp"
#include "kv_copy.cpp"
#include "bindings.cpp"
