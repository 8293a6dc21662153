// FusedDecoder: the decoder layers of a Llama-shaped model (Llama, Mistral, Qwen2, Qwen3, Phi-3 with full
// rotation) for a decode step, in one call from Python. Per layer:
//   norm -> qkv (+ bias) -> q/k norms -> rope + KV write -> decode attention -> o_proj (+ bias) + residual
//   -> norm -> gate_up -> act(gate) * up -> down + residual
// Each stage is the kernel the module path runs for the same step, with the same per-step-size matmul
// choice, so the two give the same bits; what goes away is the interpreter, the nn.Module calls and the
// Python bindings between the stages (about 330 small ops per step for SmolLM2-135M, as much time as its
// quantized matmuls at batch 1).
#include "kernels.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>
#include <vector>

namespace {

constexpr int64_t TORCH_INT4_GROUP = 32;

// oneDNN's matmul over a pre-packed bf16 weight (what torch.ops.mkldnn._linear_pointwise runs)
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

}  // namespace

// One Linear of the module path (nanoserve/model/layers/linear.py) with its choice per step size: the
// quantized weight for steps of up to max_tokens rows, else the oneDNN-packed weight, else the plain one.
struct FusedMatmul {
  at::Tensor weight;
  std::optional<at::Tensor> packed, bias;
  std::string quantized;  // "", "groups" (quant_matmul) or "torch_int4"
  at::Tensor codes, scales;  // groups: codes and scales; torch_int4: packed codes and scales_and_zeros
  int64_t bits = 0, max_tokens = 0;

  at::Tensor operator()(const at::Tensor& x) const {
    if (!quantized.empty() && x.size(0) <= max_tokens) {
      at::Tensor out = quantized == "groups"
                           ? quant_matmul(x, codes, scales, bits)
                           : at::_weight_int4pack_mm_for_cpu(x.contiguous(), codes, TORCH_INT4_GROUP,
                                                             scales.to(x.scalar_type()));
      return bias ? out + *bias : out;
    }
    if (packed) return packed_linear(x, *packed, bias);
    return at::linear(x, weight, bias);
  }
};

struct FusedLayer {
  at::Tensor input_norm, post_attention_norm;
  std::optional<at::Tensor> q_norm, k_norm;
  FusedMatmul qkv, o_proj, gate_up, down;
  std::string activation;  // silu or gelu_tanh
  int64_t window = 0;      // 0: the whole context
};

class FusedDecoder {
 public:
  FusedDecoder(std::vector<FusedLayer> layers, at::Tensor final_norm, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, double eps, double scale, double softcap)
      : layers_(std::move(layers)), final_norm_(std::move(final_norm)), num_heads_(num_heads),
        num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale), softcap_(softcap) {}

  // x: [S, hidden] embeddings of one token per sequence; cos_sin: [S, 2, 1, head_dim]; kv_caches: one per
  // layer; slot_mapping int64 [S]; block_table int32 [S, B]; seq_lens int64 [S] -> final-norm hidden [S, hidden].
  at::Tensor forward(at::Tensor x, const at::Tensor& cos_sin, const std::vector<at::Tensor>& kv_caches,
                     const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& seq_lens) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "FusedDecoder: one KV cache per layer");
    at::Tensor h = rms_norm(x, layers_[0].input_norm, eps_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const FusedLayer& layer = layers_[i];
      const at::Tensor& cache = kv_caches[i];
      at::Tensor qkv = layer.qkv(h);
      if (layer.q_norm && layer.k_norm) norm_qk_heads(qkv, *layer.q_norm, *layer.k_norm);
      at::Tensor q = rope_write_kv(qkv, cos_sin, cache, slot_mapping, num_heads_, num_kv_heads_);
      at::Tensor attended = paged_decode_attention(q, cache, block_table, seq_lens, scale_, layer.window, softcap_);
      std::tie(x, h) = add_rms_norm(x, layer.o_proj(attended), layer.post_attention_norm, eps_);
      at::Tensor gate_up = layer.gate_up(h);
      at::Tensor act = layer.activation == "silu" ? silu_and_mul(gate_up) : gelu_tanh_and_mul(gate_up);
      const at::Tensor& next_norm = i + 1 < layers_.size() ? layers_[i + 1].input_norm : final_norm_;
      std::tie(x, h) = add_rms_norm(x, layer.down(act), next_norm, eps_);
    }
    return h;
  }

 private:
  // RMSNorm over each query and key head of qkv, in place (Qwen3), as SelfAttention does it
  void norm_qk_heads(at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm) const {
    at::Tensor heads = qkv.view({qkv.size(0), -1, head_dim_});
    at::Tensor q = heads.slice(1, 0, num_heads_), k = heads.slice(1, num_heads_, num_heads_ + num_kv_heads_);
    q.copy_(rms_norm(q.reshape({-1, head_dim_}), q_norm, eps_).view_as(q));
    k.copy_(rms_norm(k.reshape({-1, head_dim_}), k_norm, eps_).view_as(k));
  }

  std::vector<FusedLayer> layers_;
  at::Tensor final_norm_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_, softcap_;
};

void register_fused_decoder(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<FusedMatmul>(m, "FusedMatmul")
      .def(py::init<>())
      .def_readwrite("weight", &FusedMatmul::weight)
      .def_readwrite("packed", &FusedMatmul::packed)
      .def_readwrite("bias", &FusedMatmul::bias)
      .def_readwrite("quantized", &FusedMatmul::quantized)
      .def_readwrite("codes", &FusedMatmul::codes)
      .def_readwrite("scales", &FusedMatmul::scales)
      .def_readwrite("bits", &FusedMatmul::bits)
      .def_readwrite("max_tokens", &FusedMatmul::max_tokens)
      .def("__call__", &FusedMatmul::operator(), py::call_guard<py::gil_scoped_release>());
  py::class_<FusedLayer>(m, "FusedLayer")
      .def(py::init<>())
      .def_readwrite("input_norm", &FusedLayer::input_norm)
      .def_readwrite("post_attention_norm", &FusedLayer::post_attention_norm)
      .def_readwrite("q_norm", &FusedLayer::q_norm)
      .def_readwrite("k_norm", &FusedLayer::k_norm)
      .def_readwrite("qkv", &FusedLayer::qkv)
      .def_readwrite("o_proj", &FusedLayer::o_proj)
      .def_readwrite("gate_up", &FusedLayer::gate_up)
      .def_readwrite("down", &FusedLayer::down)
      .def_readwrite("activation", &FusedLayer::activation)
      .def_readwrite("window", &FusedLayer::window);
  py::class_<FusedDecoder>(m, "FusedDecoder")
      .def(py::init<std::vector<FusedLayer>, at::Tensor, int64_t, int64_t, int64_t, double, double, double>())
      .def("forward", &FusedDecoder::forward, py::call_guard<py::gil_scoped_release>());
}
