// FusedDecoder: a decode step of a Llama-shaped model (Llama, Mistral, Qwen2, Qwen3, Phi-3 with full rotation,
// Gemma 2 and 3, the mixtures of experts) from token ids to the final norm, in one call from Python: the
// embedding (scaled, for Gemma) and rotary rows and each new token's cache slot are looked up here, then per
// layer:
//   norm -> qkv (+ bias) -> q/k norms -> rope + KV write -> decode attention -> o_proj (+ bias) (-> norm)
//   + residual -> norm -> gate_up -> act(gate) * up -> down (-> norm) + residual
// where the norms in brackets are Gemma's, of each block's output, a layer rotates by one of two tables
// (Gemma 3's sliding-window layers have a rotary base of their own), and a mixture of experts routes each
// token to its experts' gate_up and down (FusedExperts).
// Each stage is the kernel the module path runs for the same step, with the same per-step-size matmul
// choice, so the two give the same bits; what goes away is the interpreter, the nn.Module calls and the
// Python bindings between the stages (about 330 small ops per step for SmolLM2-135M, as much time as its
// quantized matmuls at batch 1). A prefill step runs the same stages with the prefill attention kernel
// (`prefill`), one kernel after another.
//
// A step whose every matmul is quant_matmul (bf16 or float32, small batches) or dense_matmul (float32 small
// batches), in a model without experts (their routing is ATen ops), runs in one OpenMP region: the
// threads make the same kernel calls over buffers allocated once per step, each taking its share and meeting
// the others at a barrier (work_split.h), where kernel after kernel would open a region, wake the threads and
// allocate outputs per call (at batch 1 the second thread sat idle for 60 % of the step).
#include "kernels.h"
#include "work_split.h"

#include <array>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

constexpr int64_t TORCH_INT4_GROUP = 32;

// One matmul of a decode region as its threads call it: raw pointers, looked up when the decoder is built.
template <typename T>
struct RegionMatmul {
  const uint8_t* codes;     // quant_matmul's codes and scales, for steps of up to max_tokens rows, or null
  const at::Half* scales;
  int64_t bits;
  bool lows;  // a low beside each scale, or (8 bits) low = -128 * scale
  int64_t max_tokens;
  const float* dense;  // dense_matmul's weight for the other steps (float32 models), or null
  const T* bias;       // or null
  int64_t k, n;

  // x [rows, k] -> out [rows, n] in a step that FusedDecoder::one_region_at(rows) lets run in a region
  void into(const T* x, int64_t rows, const QuantScratch& scratch, T* out) const {
    if (codes && rows <= max_tokens)
      raw::quant_matmul(x, rows, k, codes, scales, bits, lows, n, scratch, out);
    else if constexpr (std::is_same_v<T, float>)
      raw::dense_matmul(x, rows, k, dense, n, out);
    if (bias) raw::add_bias(out, bias, rows, n);
  }
};

// One Linear of the module path (nanoserve/model/layers/linear.py) with its choice per step size: the
// quantized weight for steps of up to max_tokens rows, else dense_matmul (float32), else from split_from rows
// the oneDNN-packed weight by rows, else below plain_from rows the packed weight, else the plain one.
struct FusedMatmul {
  at::Tensor weight;  // [out_features, in_features]
  std::optional<at::Tensor> packed, bias;
  bool dense = false;  // float32: dense_matmul at every step size
  std::string quantized;  // "", "groups" (quant_matmul) or "torch_int4"
  at::Tensor codes, scales;  // groups: codes and scales; torch_int4: packed codes and scales_and_zeros
  int64_t bits = 0, max_tokens = 0, plain_from = std::numeric_limits<int64_t>::max();
  int64_t split_from = std::numeric_limits<int64_t>::max();

  at::Tensor operator()(const at::Tensor& x) const {
    if (quantized_at(x.size(0))) {
      at::Tensor out = quantized == "groups"
                           ? quant_matmul(x, codes, scales, bits)
                           : at::_weight_int4pack_mm_for_cpu(x.contiguous(), codes, TORCH_INT4_GROUP,
                                                             scales.to(x.scalar_type()));
      return bias ? out + *bias : out;
    }
    if (dense) return dense_matmul(x, weight, bias);
    if (packed && x.size(0) >= split_from) return packed_linear_by_rows(x, *packed, bias, weight.size(0));
    if (packed && x.size(0) < plain_from) return packed_linear(x, *packed, bias);
    return at::linear(x, weight, bias);
  }

  bool quantized_at(int64_t rows) const { return !quantized.empty() && rows <= max_tokens; }
  bool group_quantized_at(int64_t rows) const { return quantized == "groups" && rows <= max_tokens; }
  bool dense_at(int64_t rows) const { return !quantized_at(rows) && dense; }
  // whether a step of `rows` rows runs a kernel a decode region can call: quant_matmul or dense_matmul
  bool runs_in_region_at(int64_t rows) const {
    return (group_quantized_at(rows) && quant_matmul_supported()) || dense_at(rows);
  }

  // dense_matmul's weight, where it can read it in place
  bool dense_float32() const { return dense && weight.scalar_type() == at::kFloat && weight.is_contiguous(); }

  // this matmul as a region calls it (the bias, if any, in T)
  template <typename T>
  RegionMatmul<T> in_region() const {
    const bool groups = quantized == "groups";
    return {groups ? codes.data_ptr<uint8_t>() : nullptr,
            groups ? scales.data_ptr<at::Half>() : nullptr,
            bits,
            groups && quant_scales_have_lows(scales.numel(), weight.size(1), weight.size(0), bits),
            max_tokens,
            dense_float32() ? weight.data_ptr<float>() : nullptr,
            bias ? bias->data_ptr<T>() : nullptr,
            weight.size(1),
            weight.size(0)};
  }
};

// act(gate) * up of a gated MLP's fused gate/up output
inline at::Tensor activate(const at::Tensor& gate_up, const std::string& activation) {
  return activation == "silu" ? silu_and_mul(gate_up) : gelu_tanh_and_mul(gate_up);
}

// A SparseMoE block (nanoserve/model/layers/moe.py), run as the module path runs it, op for op in ATen, so with
// the same bits: the router's top k per token, each chosen expert's gated MLP over its tokens (a lone token's
// experts one after the other, else the tokens grouped per expert), their weighted sum, and Qwen2-MoE's
// shared expert scaled by its sigmoid gate.
struct FusedExperts {
  at::Tensor router;                       // float32 [experts, hidden]
  std::vector<FusedMatmul> gate_up, down;  // per expert
  int64_t top_k = 0;
  bool normalize = false;  // the top k's weights renormalized: the softmax of their logits
  std::optional<FusedMatmul> shared_gate_up, shared_down;
  std::optional<at::Tensor> shared_gate;  // [1, hidden], the shared expert's gate

  at::Tensor operator()(const at::Tensor& x, const std::string& activation) const {
    auto [weights, experts] = route(x);
    at::Tensor out;
    if (x.size(0) == 1) {  // the choices read in place, as the module path reads them with tolist()
      const at::Tensor chosen = experts.contiguous(), chosen_weights = weights.contiguous();
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t e = chosen.data_ptr<int64_t>()[j];
        const double weight = chosen_weights.data_ptr<float>()[j];
        const at::Tensor y = down[e](activate(gate_up[e](x), activation));
        if (j == 0)
          out = y * weight;
        else
          out.add_(y, weight);
      }
    } else {
      out = grouped(x, weights, experts, activation);
    }
    if (shared_gate_up && shared_down && shared_gate)
      out = out + at::sigmoid(at::linear(x, *shared_gate)) * (*shared_down)(activate((*shared_gate_up)(x), activation));
    return out;
  }

 private:
  std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& x) const {
    const at::Tensor logits = at::linear(x.to(at::kFloat), router);
    if (normalize) {
      auto [top, experts] = logits.topk(top_k, -1);
      return {at::softmax(top, -1), experts};
    }
    return at::softmax(logits, -1).topk(top_k, -1);
  }

  at::Tensor grouped(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& experts,
                     const std::string& activation) const {
    const at::Tensor flat = experts.flatten(), order = flat.argsort(/*stable=*/true);
    const at::Tensor counts = at::bincount(flat, {}, static_cast<int64_t>(gate_up.size()));
    const at::Tensor tokens = at::floor_divide(order, top_k), inputs = x.index_select(0, tokens);
    const auto* count = counts.data_ptr<int64_t>();
    std::vector<at::Tensor> outputs;
    for (int64_t e = 0, start = 0; e < static_cast<int64_t>(gate_up.size()); start += count[e], ++e) {
      if (count[e] == 0) continue;
      const at::Tensor rows = inputs.narrow(0, start, count[e]);  // the expert's tokens, as split() cuts them
      outputs.push_back(down[e](activate(gate_up[e](rows), activation)));
    }
    const at::Tensor choice_weights = weights.flatten().index_select(0, order).unsqueeze(1).to(x.scalar_type());
    return at::zeros_like(x).index_add_(0, tokens, at::cat(outputs) * choice_weights);
  }
};

struct FusedLayer {
  at::Tensor input_norm, mlp_norm;  // of the residual stream, before the attention and before the MLP
  std::optional<at::Tensor> q_norm, k_norm;
  std::optional<at::Tensor> attention_output_norm, mlp_output_norm;  // Gemma: each block's output, before its add
  FusedMatmul qkv, o_proj, gate_up, down;  // gate_up, down: of a dense MLP
  std::optional<FusedExperts> experts;     // in place of a dense MLP
  std::string activation;     // silu or gelu_tanh
  int64_t window = 0;         // 0: the whole context
  bool local_rotary = false;  // rotates by the decoder's local table

  at::Tensor mlp(const at::Tensor& h) const {
    return experts ? (*experts)(h, activation) : down(activate(gate_up(h), activation));
  }

  std::array<const std::optional<at::Tensor>*, 4> optional_norms() const {
    return {&q_norm, &k_norm, &attention_output_norm, &mlp_output_norm};
  }

  std::array<const FusedMatmul*, 4> matmuls() const { return {&qkv, &o_proj, &gate_up, &down}; }
};

// What the threads of a decode region read of one layer besides its KV cache. Reaching each kernel's
// buffers through the layer's tensors instead cost each thread a dozen cache misses a layer (the weights
// streaming through in between evict the tensors' headers), about a microsecond before each kernel call.
template <typename T>
struct RegionLayer {
  RegionMatmul<T> qkv, o_proj, gate_up, down;
  const T *input_norm, *mlp_norm, *q_norm, *k_norm;  // q_norm, k_norm: both set (Qwen3, Gemma 3) or both null
  const T *attention_output_norm, *mlp_output_norm;  // or null
  bool gelu;
  int64_t window;
  bool local_rotary;
};

class FusedDecoder {
 public:
  // local_rotary: the table of the layers that say local_rotary (else rotary); embed_scale: what the embeddings
  // are multiplied by, in their dtype (Gemma), or none
  FusedDecoder(std::vector<FusedLayer> layers, at::Tensor final_norm, at::Tensor embedding, at::Tensor rotary,
               std::optional<at::Tensor> local_rotary, std::optional<double> embed_scale, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, double eps, double scale, double softcap)
      : layers_(std::move(layers)), final_norm_(std::move(final_norm)), embedding_(std::move(embedding)),
        rotary_(std::move(rotary)), local_rotary_(local_rotary.value_or(rotary_)), embed_scale_(embed_scale),
        num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        softcap_(softcap) {
    TORCH_CHECK(embedding_.dim() == 2 && embedding_.is_contiguous(), "FusedDecoder: a contiguous embedding");
    TORCH_CHECK(rotary_.dim() == 3 && rotary_.size(1) == 2 && rotary_dim() % 2 == 0 && rotary_dim() <= head_dim_,
                "FusedDecoder: a rotary table [positions, 2, R], R even and at most the head size");
    for (const at::Tensor* table : {&rotary_, &local_rotary_})
      TORCH_CHECK(table->sizes() == rotary_.sizes() && table->is_contiguous() &&
                      table->scalar_type() == embedding_.scalar_type(),
                  "FusedDecoder: contiguous rotary tables of one shape, in the embedding's dtype");
    for (const FusedLayer& layer : layers_)
      if (layer.experts) return;  // their routing and grouping: ATen ops, kernel after kernel
    if (!weights_fit_one_region()) return;
    if (final_norm_.scalar_type() == at::kFloat)
      float_layers_ = region_layers<float>();
    else
      bf16_layers_ = region_layers<at::BFloat16>();
  }

  // token_ids int64 [S]: each sequence's newest token, at position seq_lens - 1; kv_caches: one per layer;
  // block_table int32 [S, B] (entries of blocks behind every layer's window are never read); seq_lens int64
  // [S] -> final-norm hidden [S, hidden].
  at::Tensor forward(const at::Tensor& token_ids, const std::vector<at::Tensor>& kv_caches,
                     const at::Tensor& block_table, const at::Tensor& seq_lens) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "FusedDecoder: one KV cache per layer");
    const StepInputs in = step_inputs(token_ids, kv_caches[0].size(3), block_table, seq_lens);
    if (one_region && one_region_at(in.x.size(0)) && inputs_fit_one_region(in, kv_caches, block_table, seq_lens)) {
      ++region_steps_;
      return with_attention_types(in.x.scalar_type(), kv_caches[0].scalar_type(), [&](auto t, auto kv) {
        return forward_in_one_region<decltype(t), decltype(kv)>(in, kv_caches, block_table, seq_lens);
      });
    }
    auto attend = [&](const at::Tensor& q, const at::Tensor& cache, int64_t window) {
      return paged_decode_attention(q, cache, block_table, seq_lens, scale_, window, softcap_);
    };
    return kernel_after_kernel(in, kv_caches, attend);
  }

  // A step of prompts (or chunks of them), every sequence's attention on the prefill kernel, as the module
  // path runs it when no sequence goes to torch's flash attention: token_ids, positions, slot_mapping
  // int64 [T]; block_table int32 [S, B]; query_starts, query_lens, seq_lens int64 [S] (the sequences in
  // token order) -> final-norm hidden [T, hidden].
  at::Tensor prefill(const at::Tensor& token_ids, const at::Tensor& positions, const std::vector<at::Tensor>& kv_caches,
                     const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& query_starts,
                     const at::Tensor& query_lens, const at::Tensor& seq_lens) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "FusedDecoder: one KV cache per layer");
    TORCH_CHECK(token_ids.dim() == 1 && positions.sizes() == token_ids.sizes(), "FusedDecoder: ids and positions [T]");
    auto rows_of = [&](const at::Tensor& table) {
      return table.index_select(0, positions).view({token_ids.size(0), 2, 1, rotary_dim()});
    };
    const at::Tensor cos_sin = rows_of(rotary_);
    StepInputs in{embedding_.index_select(0, token_ids), cos_sin,
                  has_local_rotary() ? rows_of(local_rotary_) : cos_sin, slot_mapping};
    scale_embeddings(in.x);
    auto attend = [&](const at::Tensor& q, const at::Tensor& cache, int64_t window) {
      return paged_prefill_attention(q, cache, block_table, query_starts, query_lens, seq_lens, scale_, window,
                                     softcap_);
    };
    return kernel_after_kernel(in, kv_caches, attend);
  }

  bool one_region = true;  // off: kernel after kernel at every step (the region path's reference in tests)
  // the steps run in one region so far: tests check that the path they compare ran
  int64_t region_steps() const { return region_steps_; }

  // Each thread's speed over the threads' geometric mean, as the region's matmuls have measured it (empty
  // before the first); tests set it to cut the matmuls unevenly.
  std::vector<double> thread_speeds() const { return shared_.learned.relative(); }
  void set_thread_speeds(const std::vector<double>& speeds) { shared_.learned.set_relative(speeds); }

  // Whether a step of `rows` rows can run in one region: the weights fit one (weights_fit_one_region) and
  // every matmul is quant_matmul or (float32) dense_matmul at that size: the region's kernels take raw
  // pointers and check nothing.
  bool one_region_at(int64_t rows) const {
    if (float_layers_.empty() && bf16_layers_.empty()) return false;
    const auto dtype = final_norm_.scalar_type();
    for (const FusedLayer& layer : layers_)
      for (const FusedMatmul* m : layer.matmuls())
        if (!m->runs_in_region_at(rows) || (m->dense_at(rows) && (dtype != at::kFloat || !m->dense_float32())))
          return false;
    return true;
  }

 private:
  // A step's embeddings [T, hidden], rotary rows by each table [T, 2, 1, R] (local_cos_sin: cos_sin's tensor
  // where there is one table) and the cache slot each new token's K/V goes to
  struct StepInputs {
    at::Tensor x, cos_sin, local_cos_sin, slot_mapping;
  };

  bool has_local_rotary() const { return !local_rotary_.is_same(rotary_); }

  // the dims rotated at the start of each head: all of them, or fewer (Phi-4-mini's partial rotation)
  int64_t rotary_dim() const { return rotary_.size(2); }

  // x * embed_scale in x's dtype, as the module path multiplies it (CausalLM.forward)
  void scale_embeddings(at::Tensor& x) const {
    if (embed_scale_) x.mul_(at::scalar_tensor(*embed_scale_, x.options()));
  }

  // bf16 or float32 throughout: the norms and biases in the dtype of the final norm
  bool weights_fit_one_region() const {
    const auto dtype = final_norm_.scalar_type();
    if (dtype != at::kBFloat16 && dtype != at::kFloat) return false;
    for (const FusedLayer& layer : layers_) {
      for (const FusedMatmul* m : layer.matmuls())
        if ((m->bias && m->bias->scalar_type() != dtype) ||
            (m->quantized == "groups" &&
             (m->codes.scalar_type() != at::kByte || m->scales.scalar_type() != at::kHalf)))
          return false;
      for (const at::Tensor* norm : {&layer.input_norm, &layer.mlp_norm})
        if (norm->scalar_type() != dtype) return false;
      for (const std::optional<at::Tensor>* norm : layer.optional_norms())
        if (*norm && (*norm)->scalar_type() != dtype) return false;
    }
    return true;
  }

  template <typename T>
  std::vector<RegionLayer<T>> region_layers() const {
    std::vector<RegionLayer<T>> region;
    auto pointer = [](const std::optional<at::Tensor>& norm) { return norm ? norm->data_ptr<T>() : nullptr; };
    for (const FusedLayer& layer : layers_) {
      const bool qk_norms = layer.q_norm && layer.k_norm;
      region.push_back({layer.qkv.in_region<T>(), layer.o_proj.in_region<T>(), layer.gate_up.in_region<T>(),
                        layer.down.in_region<T>(), layer.input_norm.data_ptr<T>(), layer.mlp_norm.data_ptr<T>(),
                        qk_norms ? pointer(layer.q_norm) : nullptr, qk_norms ? pointer(layer.k_norm) : nullptr,
                        pointer(layer.attention_output_norm), pointer(layer.mlp_output_norm),
                        layer.activation != "silu", layer.window, layer.local_rotary});
    }
    return region;
  }

  // The layers one kernel after another, each attending with attend(q, its KV cache, its window)
  template <typename Attend>
  at::Tensor kernel_after_kernel(const StepInputs& in, const std::vector<at::Tensor>& kv_caches, Attend attend) const {
    at::Tensor x = in.x, h = rms_norm(x, layers_[0].input_norm, eps_);
    auto output = [&](at::Tensor delta, const std::optional<at::Tensor>& norm) {
      return norm ? rms_norm(delta, *norm, eps_) : delta;
    };
    for (size_t i = 0; i < layers_.size(); ++i) {
      const FusedLayer& layer = layers_[i];
      const at::Tensor& cache = kv_caches[i];
      at::Tensor qkv = layer.qkv(h);
      if (layer.q_norm && layer.k_norm) norm_qk_heads(qkv, *layer.q_norm, *layer.k_norm);
      at::Tensor q = rope_write_kv(qkv, layer.local_rotary ? in.local_cos_sin : in.cos_sin, cache, in.slot_mapping,
                                   num_heads_, num_kv_heads_);
      at::Tensor attended = output(layer.o_proj(attend(q, cache, layer.window)), layer.attention_output_norm);
      std::tie(x, h) = add_rms_norm(x, attended, layer.mlp_norm, eps_);
      const at::Tensor& next_norm = i + 1 < layers_.size() ? layers_[i + 1].input_norm : final_norm_;
      std::tie(x, h) = add_rms_norm(x, output(layer.mlp(h), layer.mlp_output_norm), next_norm, eps_);
    }
    return h;
  }

  template <typename T>
  const std::vector<RegionLayer<T>>& layers_in_region() const {
    if constexpr (std::is_same_v<T, float>)
      return float_layers_;
    else
      return bf16_layers_;
  }

  // A decode step's inputs, as the module path looks them up in Python (CausalLM.forward,
  // build_attention_metadata)
  StepInputs step_inputs(const at::Tensor& token_ids, int64_t block_size, const at::Tensor& block_table,
                         const at::Tensor& seq_lens) const {
    TORCH_CHECK(token_ids.dim() == 1 && token_ids.scalar_type() == at::kLong, "FusedDecoder: int64 token ids [S]");
    const int64_t rows = token_ids.size(0), max_blocks = block_table.size(1);
    TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == rows && seq_lens.scalar_type() == at::kLong,
                "FusedDecoder: int64 seq_lens [S]");
    TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == rows && block_table.scalar_type() == at::kInt &&
                    block_table.is_contiguous(),
                "FusedDecoder: a contiguous int32 block table [S, B]");
    const at::Tensor ids = token_ids.contiguous(), lens = seq_lens.contiguous();
    at::Tensor x = at::empty({rows, embedding_.size(1)}, embedding_.options());
    at::Tensor cos_sin = at::empty({rows, 2, 1, rotary_dim()}, rotary_.options());
    at::Tensor local_cos_sin = has_local_rotary() ? at::empty_like(cos_sin) : cos_sin;
    at::Tensor slots = at::empty({rows}, lens.options());
    const auto* id = ids.data_ptr<int64_t>();
    const auto* len = lens.data_ptr<int64_t>();
    const auto* table = block_table.data_ptr<int32_t>();
    auto* slot = slots.data_ptr<int64_t>();
    const int64_t x_row = x.size(1) * x.element_size(), rotary_row = 2 * rotary_dim() * rotary_.element_size();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t position = len[r] - 1, index = position / block_size;
      TORCH_CHECK(id[r] >= 0 && id[r] < embedding_.size(0), "FusedDecoder: token id ", id[r], " out of range");
      TORCH_CHECK(position >= 0 && position < rotary_.size(0) && index < max_blocks,
                  "FusedDecoder: position ", position, " outside the rotary table or the block table");
      const int64_t block = table[r * max_blocks + index];
      TORCH_CHECK(block >= 0, "FusedDecoder: no block for position ", position);
      std::memcpy(static_cast<char*>(x.data_ptr()) + r * x_row,
                  static_cast<const char*>(embedding_.data_ptr()) + id[r] * x_row, x_row);
      std::memcpy(static_cast<char*>(cos_sin.data_ptr()) + r * rotary_row,
                  static_cast<const char*>(rotary_.data_ptr()) + position * rotary_row, rotary_row);
      if (has_local_rotary())
        std::memcpy(static_cast<char*>(local_cos_sin.data_ptr()) + r * rotary_row,
                    static_cast<const char*>(local_rotary_.data_ptr()) + position * rotary_row, rotary_row);
      slot[r] = block * block_size + position % block_size;
    }
    scale_embeddings(x);
    return {x, cos_sin, local_cos_sin, slots};
  }

  // ... and whether the step's inputs do: the weights' dtype, contiguous, every cache in one dtype that the
  // attention kernels take with it
  bool inputs_fit_one_region(const StepInputs& in, const std::vector<at::Tensor>& kv_caches,
                             const at::Tensor& block_table, const at::Tensor& seq_lens) const {
    const at::Tensor &x = in.x, &slot_mapping = in.slot_mapping;
    const auto dtype = final_norm_.scalar_type(), cache_dtype = kv_caches[0].scalar_type();
    if (!attention_takes(dtype, cache_dtype)) return false;
    for (const at::Tensor& cache : kv_caches)  // the region reads every layer's cache with the first one's sizes
      if (cache.scalar_type() != cache_dtype || !cache.is_contiguous() || cache.sizes() != kv_caches[0].sizes() ||
          cache.size(1) != num_kv_heads_)
        return false;
    if (kv_caches[0].size(4) != (cache_dtype == at::kChar ? cache_row<int8_t>(head_dim_) : head_dim_)) return false;
    for (const at::Tensor* rows : {&x, &in.cos_sin, &in.local_cos_sin})
      if (rows->scalar_type() != dtype || !rows->is_contiguous()) return false;
    return slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
           block_table.scalar_type() == at::kInt && block_table.is_contiguous() &&
           seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous();
  }

  template <typename T, typename KV>
  at::Tensor forward_in_one_region(const StepInputs& in, const std::vector<at::Tensor>& kv_caches,
                                   const at::Tensor& block_table, const at::Tensor& seq_lens) const {
    const at::Tensor& x = in.x;
    const int64_t rows = x.size(0), hidden = x.size(1), qkv_width = (num_heads_ + 2 * num_kv_heads_) * head_dim_;
    const int64_t intermediate = layers_[0].down.weight.size(1), per_kv = num_heads_ / num_kv_heads_;
    const auto options = x.options();
    at::Tensor residual = at::empty({rows, hidden}, options), h = at::empty({rows, hidden}, options);
    at::Tensor delta = at::empty({rows, hidden}, options), qkv = at::empty({rows, qkv_width}, options);
    at::Tensor q = at::empty({rows, num_heads_, head_dim_}, options);
    at::Tensor attended = at::empty({rows, num_heads_ * head_dim_}, options);
    at::Tensor gate_up = at::empty({rows, 2 * intermediate}, options), act = at::empty({rows, intermediate}, options);
    const int64_t widest = std::max({hidden, intermediate, num_heads_ * head_dim_});
    at::Tensor xq = at::empty({rows * widest}, options.dtype(at::kChar));
    at::Tensor x_stats = at::empty({2 * rows * widest / 32}, options.dtype(at::kFloat));
    const QuantScratch scratch{xq.data_ptr<int8_t>(), x_stats.data_ptr<float>(),
                               x_stats.data_ptr<float>() + rows * widest / 32};
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    std::vector<AttentionSplit> splits;
    int64_t scratch_floats = 0;
    for (const FusedLayer& layer : layers_) {
      splits.push_back(attention_split(lens, rows, num_kv_heads_, layer.window));
      scratch_floats = std::max(scratch_floats, splits.back().scratch_floats(per_kv, head_dim_));
    }
    std::vector<float> attention_scratch(scratch_floats);
    const T* input = x.data_ptr<T>();
    const T *cs = in.cos_sin.data_ptr<T>(), *local_cs = in.local_cos_sin.data_ptr<T>();
    const int64_t rotary_dim = this->rotary_dim();  // read once: the region's threads would each reach rotary_
    const int64_t* slots = in.slot_mapping.data_ptr<int64_t>();
    T *res = residual.data_ptr<T>(), *hn = h.data_ptr<T>(), *dl = delta.data_ptr<T>();
    T *qkv_p = qkv.data_ptr<T>(), *q_p = q.data_ptr<T>(), *att = attended.data_ptr<T>();
    T *gu = gate_up.data_ptr<T>(), *ac = act.data_ptr<T>();
    const float eps = static_cast<float>(eps_);
    const std::vector<RegionLayer<T>>& layers = layers_in_region<T>();
    std::vector<KV*> caches;
    for (const at::Tensor& cache : kv_caches) caches.push_back(cache.data_ptr<KV>());
    const int64_t slots_per_head = kv_caches[0].size(2) * kv_caches[0].size(3);
    const DecodeAttentionShape shape{num_heads_, num_kv_heads_, head_dim_, kv_caches[0].size(2), kv_caches[0].size(3),
                                     block_table.size(1)};
    const int32_t* table = block_table.data_ptr<int32_t>();
    const T* final_norm = final_norm_.data_ptr<T>();

#pragma omp parallel num_threads(at::get_num_threads())
    {
      DecodeRegion region(shared_);
      const T* stream = input;  // the residual stream: the embeddings, then `res`
      raw::rms_norm(input, layers[0].input_norm, hn, rows, hidden, eps);
      for (size_t i = 0; i < layers.size(); ++i) {
        const RegionLayer<T>& layer = layers[i];
        prefetch_new_kv_rows(caches[i], slots, rows, slots_per_head);
        layer.qkv.into(hn, rows, scratch, qkv_p);
        if (layer.q_norm)
          raw::norm_heads(qkv_p, layer.q_norm, layer.k_norm, rows, num_heads_, num_kv_heads_, head_dim_, eps);
        raw::rope_write_kv(qkv_p, layer.local_rotary ? local_cs : cs, q_p, caches[i], slots, rows, num_heads_,
                           num_kv_heads_, head_dim_, rotary_dim, slots_per_head);
        raw::decode_attention(q_p, caches[i], table, lens, shape, scale_, layer.window, softcap_, splits[i],
                              attention_scratch.data(), att);
        layer.o_proj.into(att, rows, scratch, dl);
        if (layer.attention_output_norm) raw::rms_norm(dl, layer.attention_output_norm, dl, rows, hidden, eps);
        raw::add_rms_norm(stream, dl, res, layer.mlp_norm, hn, rows, hidden, eps);
        stream = res;
        layer.gate_up.into(hn, rows, scratch, gu);
        raw::act_and_mul(layer.gelu, gu, ac, rows, intermediate);
        layer.down.into(ac, rows, scratch, dl);
        if (layer.mlp_output_norm) raw::rms_norm(dl, layer.mlp_output_norm, dl, rows, hidden, eps);
        const bool last = i + 1 == layers.size();
        if (!last) prefetch_lines(&layers[i + 1], sizeof layers[i + 1]);
        raw::add_rms_norm(res, dl, res, last ? final_norm : layers[i + 1].input_norm, hn, rows, hidden, eps);
      }
    }
    return h;
  }

  // the lines of an object the caches have likely lost, asked for ahead of its use
  static void prefetch_lines(const void* object, size_t bytes) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(object), end = start + bytes;
    for (uintptr_t line = start & ~uintptr_t{63}; line < end; line += 64)
      __builtin_prefetch(reinterpret_cast<const void*>(line));
  }

  // The cache lines that rope_write_kv will write the step's new K and V rows to, asked for while the qkv
  // matmul runs. Up to ROPE_GRAIN_TOKENS tokens, thread 0 writes them all; the rows of a layer's cache are
  // long out of cache by then, and a few dozen stores to lines not there kept thread 0 (and the others at
  // the next barrier) waiting for microseconds.
  template <typename T>
  void prefetch_new_kv_rows(const T* cache, const int64_t* slots, int64_t rows, int64_t slots_per_head) const {
    if (rows > raw::ROPE_GRAIN_TOKENS || omp_get_thread_num() != 0) return;
    const int64_t cached_row = cache_row<T>(head_dim_), row_bytes = cached_row * sizeof(T);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t head = 0; head < 2 * num_kv_heads_; ++head) {  // K heads, then V heads
        const char* row = reinterpret_cast<const char*>(cache + (head * slots_per_head + slots[r]) * cached_row);
        for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(row + byte, 1);
      }
  }

  // RMSNorm over each query and key head of qkv, in place (Qwen3), as SelfAttention does it
  void norm_qk_heads(at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm) const {
    at::Tensor heads = qkv.view({qkv.size(0), -1, head_dim_});
    at::Tensor q = heads.slice(1, 0, num_heads_), k = heads.slice(1, num_heads_, num_heads_ + num_kv_heads_);
    q.copy_(rms_norm(q.reshape({-1, head_dim_}), q_norm, eps_).view_as(q));
    k.copy_(rms_norm(k.reshape({-1, head_dim_}), k_norm, eps_).view_as(k));
  }

  std::vector<FusedLayer> layers_;
  // layers_ as a region reads them, in the model's dtype; both empty where the weights fit no region
  std::vector<RegionLayer<float>> float_layers_;
  std::vector<RegionLayer<at::BFloat16>> bf16_layers_;
  at::Tensor final_norm_, embedding_;
  at::Tensor rotary_, local_rotary_;  // cos/sin tables [positions, 2, R]; local_rotary_: rotary_ itself if one
  std::optional<double> embed_scale_;
  // the region's barrier and the threads' speeds, learned step after step: one forward at a time, as the KV
  // caches need anyway
  mutable RegionShared shared_;
  mutable int64_t region_steps_ = 0;
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
      .def_readwrite("dense", &FusedMatmul::dense)
      .def_readwrite("plain_from", &FusedMatmul::plain_from)
      .def_readwrite("split_from", &FusedMatmul::split_from)
      .def_readwrite("quantized", &FusedMatmul::quantized)
      .def_readwrite("codes", &FusedMatmul::codes)
      .def_readwrite("scales", &FusedMatmul::scales)
      .def_readwrite("bits", &FusedMatmul::bits)
      .def_readwrite("max_tokens", &FusedMatmul::max_tokens)
      .def("__call__", &FusedMatmul::operator(), py::call_guard<py::gil_scoped_release>());
  py::class_<FusedExperts>(m, "FusedExperts")
      .def(py::init<>())
      .def_readwrite("router", &FusedExperts::router)
      .def_readwrite("gate_up", &FusedExperts::gate_up)
      .def_readwrite("down", &FusedExperts::down)
      .def_readwrite("top_k", &FusedExperts::top_k)
      .def_readwrite("normalize", &FusedExperts::normalize)
      .def_readwrite("shared_gate_up", &FusedExperts::shared_gate_up)
      .def_readwrite("shared_down", &FusedExperts::shared_down)
      .def_readwrite("shared_gate", &FusedExperts::shared_gate)
      .def("__call__", &FusedExperts::operator(), py::call_guard<py::gil_scoped_release>());
  py::class_<FusedLayer>(m, "FusedLayer")
      .def(py::init<>())
      .def_readwrite("input_norm", &FusedLayer::input_norm)
      .def_readwrite("mlp_norm", &FusedLayer::mlp_norm)
      .def_readwrite("q_norm", &FusedLayer::q_norm)
      .def_readwrite("k_norm", &FusedLayer::k_norm)
      .def_readwrite("attention_output_norm", &FusedLayer::attention_output_norm)
      .def_readwrite("mlp_output_norm", &FusedLayer::mlp_output_norm)
      .def_readwrite("qkv", &FusedLayer::qkv)
      .def_readwrite("o_proj", &FusedLayer::o_proj)
      .def_readwrite("gate_up", &FusedLayer::gate_up)
      .def_readwrite("down", &FusedLayer::down)
      .def_readwrite("experts", &FusedLayer::experts)
      .def_readwrite("activation", &FusedLayer::activation)
      .def_readwrite("window", &FusedLayer::window)
      .def_readwrite("local_rotary", &FusedLayer::local_rotary);
  py::class_<FusedDecoder>(m, "FusedDecoder")
      .def(py::init<std::vector<FusedLayer>, at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>,
                    std::optional<double>, int64_t, int64_t, int64_t, double, double, double>())
      .def_readwrite("one_region", &FusedDecoder::one_region)
      .def_property_readonly("region_steps", &FusedDecoder::region_steps)
      .def("one_region_at", &FusedDecoder::one_region_at)
      .def_property("thread_speeds", &FusedDecoder::thread_speeds, &FusedDecoder::set_thread_speeds)
      .def("forward", &FusedDecoder::forward, py::call_guard<py::gil_scoped_release>())
      .def("prefill", &FusedDecoder::prefill, py::call_guard<py::gil_scoped_release>());
}
