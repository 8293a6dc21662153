// CPU kernels for the steps where PyTorch's eager ops cost more in dispatch and copies than in work.
//
// paged_decode_attention: one query token per sequence, grouped-query heads, straight from the paged KV
// cache. Each (sequence, KV head) pair is one task: its query heads' scores over the context, a softmax,
// and the weighted sum of V, reading each cached K and V row once, in place (no gather of the context).
//
// rms_norm: one pass per row in float32, where PyTorch's CPU rms_norm is a chain of eight ops.
//
// write_kv: the new tokens' K and V rows into their cache slots, one copy each, where index_copy_ on
// the cache's strided view costs two ops and a slow path.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;  // bf16 is the high half of a float
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(float x) { return x; }

template <typename T>
void decode_attention(const T* q, const T* kv, const int32_t* block_table, const int64_t* seq_lens, T* out,
                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                      int64_t block_size, int64_t head_dim, int64_t max_blocks, float scale) {
  const int64_t per_kv = num_heads / num_kv_heads;
  const int64_t v_offset = num_kv_heads * num_blocks * block_size * head_dim;  // kv[1] - kv[0]
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(per_kv * head_dim), acc(per_kv * head_dim), scores;
    std::vector<float> row(head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t context = seq_lens[seq];
      for (int64_t h = 0; h < per_kv; ++h)
        for (int64_t d = 0; d < head_dim; ++d)
          query[h * head_dim + d] = to_float(q[(seq * num_heads + kv_head * per_kv + h) * head_dim + d]) * scale;
      scores.assign(per_kv * context, 0.f);
      const T* k_head = kv + kv_head * num_blocks * block_size * head_dim;
      for (int64_t t = 0; t < context; ++t) {
        const int64_t block = block_table[seq * max_blocks + t / block_size];
        const T* k = k_head + (block * block_size + t % block_size) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) row[d] = to_float(k[d]);
        for (int64_t h = 0; h < per_kv; ++h) {
          float dot = 0.f;
          const float* qh = query.data() + h * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * row[d];
          scores[h * context + t] = dot;
        }
      }
      for (int64_t h = 0; h < per_kv; ++h) {
        float* s = scores.data() + h * context;
        float max_score = -INFINITY, total = 0.f;
        for (int64_t t = 0; t < context; ++t) max_score = std::max(max_score, s[t]);
        for (int64_t t = 0; t < context; ++t) total += (s[t] = std::exp(s[t] - max_score));
        const float inv = 1.f / total;
        for (int64_t t = 0; t < context; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const T* v_head = k_head + v_offset;
      for (int64_t t = 0; t < context; ++t) {
        const int64_t block = block_table[seq * max_blocks + t / block_size];
        const T* v = v_head + (block * block_size + t % block_size) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) row[d] = to_float(v[d]);
        for (int64_t h = 0; h < per_kv; ++h) {
          const float p = scores[h * context + t];
          float* a = acc.data() + h * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
        }
      }
      for (int64_t h = 0; h < per_kv; ++h)
        for (int64_t d = 0; d < head_dim; ++d)
          out[(seq * num_heads + kv_head * per_kv + h) * head_dim + d] = static_cast<T>(acc[h * head_dim + d]);
    }
  });
}

}  // namespace

// q: [S, H, D]; kv_cache: [2, Hkv, num_blocks, block_size, D]; block_table: int32 [S, max_blocks];
// seq_lens: int64 [S] (context including the new token, already written to the cache) -> [S, H * D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_table.is_contiguous());
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and the KV cache must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt64);
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  auto out = torch::empty({num_seqs, num_heads * head_dim}, q.options());
  auto lens = seq_lens.contiguous();
  if (q.scalar_type() == torch::kBFloat16) {
    decode_attention(q.data_ptr<at::BFloat16>(), kv_cache.data_ptr<at::BFloat16>(), block_table.data_ptr<int32_t>(),
                     lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), num_seqs, num_heads, num_kv_heads,
                     num_blocks, block_size, head_dim, block_table.size(1), static_cast<float>(scale));
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kFloat32, "bfloat16 or float32 only");
    decode_attention(q.data_ptr<float>(), kv_cache.data_ptr<float>(), block_table.data_ptr<int32_t>(),
                     lens.data_ptr<int64_t>(), out.data_ptr<float>(), num_seqs, num_heads, num_kv_heads,
                     num_blocks, block_size, head_dim, block_table.size(1), static_cast<float>(scale));
  }
  return out;
}

namespace {

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(hidden);
    for (int64_t i = 0; i < hidden; ++i) w[i] = to_float(weight[i]);
    std::vector<float> row(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* in = x + r * hidden;
      float squares = 0.f;
      for (int64_t i = 0; i < hidden; ++i) {
        row[i] = to_float(in[i]);
        squares += row[i] * row[i];
      }
      const float inv_rms = 1.f / std::sqrt(squares / hidden + eps);
      T* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) o[i] = static_cast<T>(row[i] * inv_rms * w[i]);
    }
  });
}

}  // namespace

// x: [T, hidden], weight: [hidden] -> [T, hidden]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && x.size(1) == weight.size(0));
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  auto in = x.contiguous();
  auto out = torch::empty_like(in);
  if (x.scalar_type() == torch::kBFloat16) {
    rms_norm_rows(in.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                  in.size(0), in.size(1), static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "bfloat16 or float32 only");
    rms_norm_rows(in.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), in.size(0), in.size(1),
                  static_cast<float>(eps));
  }
  return out;
}

// kv_cache: [2, Hkv, num_blocks, block_size, D]; k, v: [T, Hkv, D] (any strides along T and Hkv, D
// contiguous); slot_mapping: int64 [T], slot = block * block_size + offset.
void write_kv(torch::Tensor kv_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.is_contiguous() && k.stride(2) == 1 && v.stride(2) == 1);
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type());
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous());
  const int64_t num_tokens = k.size(0), num_kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t slots_per_head = kv_cache.size(2) * kv_cache.size(3);
  const int64_t row_bytes = head_dim * kv_cache.element_size();
  auto* cache = static_cast<char*>(kv_cache.data_ptr());
  const auto* k_base = static_cast<const char*>(k.data_ptr());
  const auto* v_base = static_cast<const char*>(v.data_ptr());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t item = kv_cache.element_size();
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t k_row = (h * slots_per_head + slots[t]) * row_bytes;
      const int64_t v_row = ((num_kv_heads + h) * slots_per_head + slots[t]) * row_bytes;
      std::memcpy(cache + k_row, k_base + (t * k.stride(0) + h * k.stride(1)) * item, row_bytes);
      std::memcpy(cache + v_row, v_base + (t * v.stride(0) + h * v.stride(1)) * item, row_bytes);
    }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("rms_norm", &rms_norm);
  m.def("write_kv", &write_kv);
}
