// The entry points of nano-vllm's CPU kernels, one declaration each: bindings.cpp exposes them to Python and
// decoder_stack.cpp calls them from its C++ loop over the decoder layers.
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                              torch::Tensor v_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
                              torch::Tensor seq, torch::Tensor pos, double scale);
torch::Tensor paged_attention_8bit(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                                   torch::Tensor v_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
                                   torch::Tensor seq, torch::Tensor pos, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
std::tuple<torch::Tensor, torch::Tensor> greedy_sample(torch::Tensor logits);
bool gemv_available();
torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                           c10::optional<torch::Tensor> mins, c10::optional<torch::Tensor> bias, int64_t format);
std::string quant_gemm_isa();
bool q4x16_available();
bool i8x16_available();
torch::Tensor q4x16_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor mins,
                           c10::optional<torch::Tensor> bias, int64_t out_features);
torch::Tensor i8x16_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                           c10::optional<torch::Tensor> bias, int64_t out_features);
bool int8_amx_available();
torch::Tensor pack_int8_amx(torch::Tensor codes);
torch::Tensor int8_amx_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                              c10::optional<torch::Tensor> bias, int64_t out_features);
bool brgemm_bf16_available();
torch::Tensor pack_brgemm_weight(torch::Tensor weight);
torch::Tensor brgemm_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                            int64_t out_features);
void bind_decoder_stack(pybind11::module& m);
