// The fast path's decoder layers run as one C++ loop (LlamaForCausalLM.forward on CPU, models/llama.py).
//
// The Python loop over layers calls the same kernels in the same order (fused add + RMSNorm, the fused q/k/v
// linear, rotary, paged attention, o_proj, add + RMSNorm, gate/up, SiLU-and-mul, down_proj), but around each
// kernel it pays a module call, a reshape or two and an argument parse, which on a slow core cost as much as
// a small linear's kernel itself at batch 1 (SmolLM2-135M's Q4_1 o_proj). Here the loop and the
// views cost nanoseconds, and the GIL is released for the whole step. The arithmetic is unchanged: every
// result is bitwise the Python loop's (tests/models/test_decoder_stack.py).
#include "kernels.h"

#include <torch/python.h>

#include <vector>

namespace {

// The kernels a stacked linear can run: the fast path's CPU linears (PackedLinear "brgemm", "onednn",
// "onednn+gemv" and "bf16-fma", QuantLinear's "q4x16", "i8x16", "q8x16", "vector" and "amx", and "aten", torch's
// own linear, for a plain nn.Linear: bf16 at the scalar level, where no packed kernel takes it). Python names them
// by these strings (stack_linear() in fast_path.py and quantized.py, llama.py for nn.Linear); a layer whose linear
// runs anything else keeps the Python loop.
enum class LinearKind { kBrgemm, kOneDnn, kOneDnnGemv, kBf16Fma, kQ4x16, kI8x16, kQ8x16, kQuant, kInt8Amx, kAten };

LinearKind linear_kind(const std::string& name) {
  if (name == "brgemm") return LinearKind::kBrgemm;
  if (name == "onednn") return LinearKind::kOneDnn;
  if (name == "onednn+gemv") return LinearKind::kOneDnnGemv;
  if (name == "bf16-fma") return LinearKind::kBf16Fma;
  if (name == "q4x16") return LinearKind::kQ4x16;
  if (name == "i8x16") return LinearKind::kI8x16;
  if (name == "q8x16") return LinearKind::kQ8x16;
  if (name == "vector") return LinearKind::kQuant;
  if (name == "amx") return LinearKind::kInt8Amx;
  if (name == "aten") return LinearKind::kAten;
  TORCH_CHECK(false, "DecoderStack: no stacked kernel named '", name,
              "' (brgemm, onednn, onednn+gemv, bf16-fma, q4x16, i8x16, q8x16, vector, amx, aten)");
}

// oneDNN's prepacked linear, torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""), the call
// PackedLinear.forward makes. It is registered with torch's dispatcher, not declared in a public header, so it is
// called boxed, which costs far less than the Python module call around it.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                            const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                          c10::IValue(std::string("none")), c10::IValue(c10::List<c10::optional<at::Scalar>>()),
                          c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// One linear layer's weights and the kernel that multiplies by them (the same call its Python module makes).
struct StackLinear {
  LinearKind kind;
  at::Tensor weight;  // packed brgemm, oneDNN or bf16-fma weight, Q4x16 / I8x16 codes, quantized codes,
                      // AMX-packed int8, or the plain [N, K] weight (aten)
  at::Tensor scales;  // empty for brgemm and oneDNN
  c10::optional<at::Tensor> mins, bias;
  int64_t out_features, format;
  int64_t activation_digits;  // "amx": the int8 digits per token of the activations (QuantLinear.activation_digits)
  at::Tensor gemv_weight;  // "onednn+gemv": the plain [N, K] weight the GEMV reads
  int64_t gemv_max_rows;      // the rows up to which "onednn+gemv" runs the GEMV (PackedLinear.GEMV_MAX_ROWS)

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind) {
      case LinearKind::kBrgemm: return brgemm_linear(x, weight, bias, out_features);
      case LinearKind::kOneDnnGemv:
        if (x.size(0) <= gemv_max_rows) return gemv_bf16(x, gemv_weight, bias);
        return onednn_linear(x, weight, bias);
      case LinearKind::kOneDnn: return onednn_linear(x, weight, bias);
      case LinearKind::kBf16Fma: return bf16_fma_linear(x, weight, bias, out_features);
      case LinearKind::kQ4x16: return q4x16_linear(x, weight, scales, *mins, bias, out_features);
      case LinearKind::kI8x16: return i8x16_linear(x, weight, scales, bias, out_features);
      case LinearKind::kQ8x16: return q8x16_linear(x, weight, scales, bias, out_features);
      case LinearKind::kQuant: return quant_linear(x, weight, scales, mins, bias, format);
      case LinearKind::kInt8Amx: return int8_amx_linear(x, weight, scales, bias, out_features, activation_digits);
      case LinearKind::kAten: return at::linear(x, weight, bias);
    }
    TORCH_CHECK(false, "StackLinear: unknown kind");
  }
};

StackLinear make_stack_linear(const std::string& kind, at::Tensor weight, c10::optional<at::Tensor> scales,
                              c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias,
                              int64_t out_features, int64_t format, c10::optional<at::Tensor> gemv_weight,
                              int64_t gemv_max_rows, int64_t activation_digits) {
  StackLinear linear{linear_kind(kind), weight, scales.value_or(at::Tensor()), mins, bias, out_features, format,
                     activation_digits, gemv_weight.value_or(at::Tensor()), gemv_max_rows};
  TORCH_CHECK(activation_digits == 1 || activation_digits == 2, "StackLinear: activation_digits must be 1 or 2");
  const bool dense = linear.kind == LinearKind::kBrgemm || linear.kind == LinearKind::kOneDnn ||
                     linear.kind == LinearKind::kOneDnnGemv || linear.kind == LinearKind::kBf16Fma ||
                     linear.kind == LinearKind::kAten;
  TORCH_CHECK(dense || scales.has_value(), "StackLinear '", kind, "' needs scales");
  TORCH_CHECK(linear.kind != LinearKind::kQ4x16 || mins.has_value(), "StackLinear 'q4x16' needs mins");
  TORCH_CHECK(linear.kind != LinearKind::kOneDnnGemv || (gemv_weight.has_value() && gemv_available()),
              "StackLinear 'onednn+gemv' needs the plain weight and a build with the bf16 GEMV");
  return linear;
}

// The decoder layers of one model (Llama family without q/k norm), built once from its fast-path modules.
class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, at::Tensor final_norm)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), final_norm_(final_norm) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, StackLinear qkv, StackLinear o,
                 StackLinear gate_up, StackLinear down) {
    layers_.push_back({input_norm, post_norm, qkv, o, gate_up, down});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // residual: the embedded tokens [T, hidden], contiguous, updated in place as the residual stream. cos/sin:
  // float32 rows [T, head_dim]. The KV caches (one pair per layer) and the attention plan (slot_mapping,
  // block_tables, seq, pos) and softmax scale are CpuAttention's for this step. Returns the final RMSNorm of the residual.
  at::Tensor forward(at::Tensor residual, at::Tensor cos, at::Tensor sin,
                        const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                        at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq, at::Tensor pos,
                        bool eight_bit_cache, double scale) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "DecoderStack.forward: one K and one V cache per layer (", layers_.size(), "), got ",
                k_caches.size(), " and ", v_caches.size());
    TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "DecoderStack.forward: residual [T, hidden]");
    TORCH_CHECK(!layers_.empty(), "DecoderStack.forward: no layers");
    const int64_t tokens = residual.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    at::Tensor delta;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      auto normed = i == 0 ? rms_norm(residual, layer.input_norm, eps_)
                           : add_rms_norm_(residual, delta, layer.input_norm, eps_);
      auto qkv = layer.qkv(normed);
      auto q = qkv.narrow(1, 0, q_size).reshape({tokens, num_heads_, head_dim_});
      auto k = qkv.narrow(1, q_size, kv_size).reshape({tokens, num_kv_heads_, head_dim_});
      auto v = qkv.narrow(1, q_size + kv_size, kv_size).reshape({tokens, num_kv_heads_, head_dim_});
      rotary_(q, k, cos, sin);
      const auto& k_cache = k_caches[i];
      const auto& v_cache = v_caches[i];
      auto attended = eight_bit_cache
          ? paged_attention_8bit(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq, pos, scale)
          : paged_attention(q, k.to(k_cache.scalar_type()), v.to(v_cache.scalar_type()), k_cache, v_cache,
                            slot_mapping, block_tables, seq, pos, scale);
      auto mlp_in = add_rms_norm_(residual, layer.o(attended), layer.post_norm, eps_);
      delta = layer.down(silu_and_mul(layer.gate_up(mlp_in)));
    }
    return add_rms_norm_(residual, delta, final_norm_, eps_);
  }

 private:
  struct Layer {
    at::Tensor input_norm, post_norm;
    StackLinear qkv, o, gate_up, down;
  };
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_;
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
};

}  // namespace

void bind_decoder_stack(pybind11::module& m) {
  namespace py = pybind11;
  // module_local: each ISA level's build has its own classes, and the tests load several builds in one process.
  py::class_<StackLinear>(m, "StackLinear", "One linear of a DecoderStack: its weights and kernel", py::module_local());
  m.def("stack_linear", &make_stack_linear, py::arg("kind"), py::arg("weight"), py::arg("scales"), py::arg("mins"),
        py::arg("bias"), py::arg("out_features"), py::arg("format") = 0, py::arg("gemv_weight") = py::none(),
        py::arg("gemv_max_rows") = 0, py::arg("activation_digits") = 2,
        "A DecoderStack linear: kind 'brgemm' | 'onednn' | 'onednn+gemv' | 'bf16-fma' | 'q4x16' | 'i8x16' | 'q8x16' | "
        "'vector' | 'amx' | 'aten', with that kernel's arguments");
  py::class_<DecoderStack>(m, "DecoderStack", "The fast path's decoder layers as one C++ loop (CPU)", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, double, at::Tensor>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("final_norm"))
      .def("add_layer", &DecoderStack::add_layer)
      .def("num_layers", &DecoderStack::num_layers)
      // No Python object is touched inside: other threads (the HTTP server's event loop) run meanwhile.
      .def("forward", &DecoderStack::forward, py::call_guard<py::gil_scoped_release>());
}
