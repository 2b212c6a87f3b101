// The entry points of nano-vllm's CPU kernels, one declaration each: bindings.cpp exposes them to Python and
// decoder_stack.cpp calls them from its C++ loop over the decoder layers.
//
// Kernel sources include ATen and torch/library.h, never <torch/extension.h>: that header pulls in all of libtorch's
// C++ frontend (nn, optim, data) and made each file take several times as long to compile; only the two files that
// talk to Python (bindings.cpp, decoder_stack.cpp) include <torch/python.h>.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>

at::Tensor paged_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                              at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables,
                              at::Tensor seq, at::Tensor pos, double scale);
at::Tensor paged_attention_8bit(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                                   at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables,
                                   at::Tensor seq, at::Tensor pos, double scale);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm_(at::Tensor residual, at::Tensor delta, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor gate_up);
void rotary_(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin);
std::tuple<at::Tensor, at::Tensor> greedy_sample(at::Tensor logits);
bool gemv_available();
at::Tensor gemv_bf16(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias);
at::Tensor quant_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales,
                           c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias, int64_t format);
std::string quant_gemm_isa();
bool q4x16_available();
bool i8x16_available();
bool q8x16_available();
at::Tensor q4x16_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor mins,
                           c10::optional<at::Tensor> bias, int64_t out_features);
at::Tensor i8x16_linear(at::Tensor x, at::Tensor codes, at::Tensor scales,
                           c10::optional<at::Tensor> bias, int64_t out_features);
at::Tensor q8x16_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> bias,
                        int64_t out_features);
bool int8_amx_available();
at::Tensor pack_int8_amx(at::Tensor codes);
at::Tensor int8_amx_linear(at::Tensor x, at::Tensor packed, at::Tensor scales,
                              c10::optional<at::Tensor> bias, int64_t out_features, int64_t digits = 2);
bool brgemm_bf16_available();
at::Tensor pack_brgemm_weight(at::Tensor weight);
at::Tensor brgemm_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias,
                            int64_t out_features);
bool bf16_fma_available();
at::Tensor pack_bf16_fma_weight(at::Tensor weight);
at::Tensor bf16_fma_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t out_features);
std::string kv_copy_isa();
void copy_kv_blocks(at::Tensor pool, at::Tensor src, at::Tensor runs);
