// The kernels' tensor-level entry points, shared by the Python bindings (cpu_kernels.cpp) and the fused
// decode step (fused_decoder.cpp), which calls them one after another without going back to Python.
#pragma once

#include <torch/extension.h>

#include <cstring>
#include <tuple>

// bf16 is the high half of a float32
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(float x) { return x; }

// The head sizes the attention kernels compile as constants (others take their generic path).
#define NANOSERVE_FOR_EACH_HEAD_DIM(CASE) CASE(32) CASE(64) CASE(80) CASE(96) CASE(128) CASE(256)

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                                     torch::Tensor seq_lens, double scale, int64_t window, double softcap);
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                                      torch::Tensor query_starts, torch::Tensor query_lens, torch::Tensor seq_lens,
                                      double scale, int64_t window, double softcap);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight,
                                                      double eps);
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos_sin, torch::Tensor kv_cache,
                            torch::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor gelu_tanh_and_mul(torch::Tensor x);
bool quant_matmul_supported();
torch::Tensor quant_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t bits);

torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k,
                          torch::Tensor top_p, torch::Tensor min_p, torch::Tensor uniforms);

void register_fused_decoder(pybind11::module& m);
