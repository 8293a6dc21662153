// The kernels' tensor-level entry points, shared by the Python bindings (cpu_kernels.cpp) and the fused
// decode step (fused_decoder.cpp), which calls them one after another without going back to Python.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>

// bf16 is the high half of a float32
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(float x) { return x; }
// an fp8 e5m2 byte is the high byte of the float16 of the same value (c10's own conversion, inlined)
inline float to_float(at::Float8_e5m2 x) { return static_cast<float>(x); }

#if defined(__AVX2__)
#include <immintrin.h>

// 8 values as float32 lanes
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#if defined(__F16C__)
inline __m256 load8(const at::Float8_e5m2* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
}
#endif
// 8 float32 lanes rounded to bfloat16's precision, to nearest even (as torch rounds): the bfloat16 in the
// high half of each lane, zeros below
inline __m256i round_to_bf16(__m256 values) {
  const __m256i bits = _mm256_castps_si256(values);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  return _mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u)));
}
// 8 float32 lanes stored as float32, or as bfloat16 rounded to nearest even
inline void store8(float* p, __m256 values) { _mm256_storeu_ps(p, values); }
inline void store8(at::BFloat16* p, __m256 values) {
  const __m256i words = _mm256_srli_epi32(round_to_bf16(values), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
}
#endif

#if defined(__AVX512F__)
// 16 values as float32 lanes
inline __m512 load16f(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16f(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16f(const at::Float8_e5m2* p) {
  const __m256i halves = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(halves, 8));
}
// 16 float32 lanes rounded to bfloat16's precision, as round_to_bf16 above
inline __m512i round_to_bf16(__m512 values) {
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u)));
}
// 16 float32 lanes stored as float32, or as bfloat16 rounded to nearest even
inline void store16f(float* p, __m512 values) { _mm512_storeu_ps(p, values); }
inline void store16f(at::BFloat16* p, __m512 values) {
  const __m256i words = _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_to_bf16(values), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), words);
}
#endif

#if defined(__AVX512BF16__)
// n values (a multiple of 16) of an fp8 e5m2 cache as bfloat16, exactly: widened to float32 by way of
// float16, then narrowed (every e5m2 value is a bf16 value), for the bf16 pair dot products
inline void widen_to_bf16(const at::Float8_e5m2* src, at::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(load16f(src + i)));
}
#endif

// An int8 cache row (--kv-cache-dtype int8): a head's D codes, then the row's float32 scale, the row's
// largest magnitude times INT8_STEP; a value is code * scale (a row under FLT_MIN / INT8_STEP: codes of
// 0). nanoserve/model/kv_rows.py writes and reads the same rows in PyTorch, with the same arithmetic, so
// that both paths hold the same codes.
constexpr int64_t INT8_SCALE_BYTES = 4;
constexpr float INT8_STEP = 1.f / 127.f;
// the elements of a cached row of KV's type for a head of head_dim values
template <typename KV>
constexpr int64_t cache_row(int64_t head_dim) {
  return head_dim + (std::is_same_v<KV, int8_t> ? INT8_SCALE_BYTES : 0);
}

// x [D] (values already rounded to the activations' dtype) -> an int8 row
inline void quantize_int8_row(const float* x, int64_t D, int8_t* row) {
  float largest = 0.f;
  for (int64_t d = 0; d < D; ++d) largest = std::max(largest, std::fabs(x[d]));
  float scale = largest * INT8_STEP;
  // -ffast-math may rewrite 1 / (largest * INT8_STEP) as 127.000001 / largest, and x * (1 / scale) as
  // x / scale: each moves a code at a tie (63.5 one way or the other) off PyTorch's. The empty asm
  // statements hide where the values came from.
  asm volatile("" : "+m"(scale));
  float inverse = scale >= FLT_MIN ? 1.f / scale : 0.f;
  asm volatile("" : "+m"(inverse));
  for (int64_t d = 0; d < D; ++d) row[d] = static_cast<int8_t>(std::nearbyint(x[d] * inverse));
  std::memcpy(row + D, &scale, sizeof scale);
}

// an int8 row -> its D values, code * scale in float32, rounded to R (float32 or bf16, to nearest even: the
// values PyTorch's path attends over) and stored as W (R, or float32 for loops that read float32 rows)
template <typename R, typename W>
inline void dequantize_int8_row(const int8_t* row, int64_t D, W* out) {
  static_assert(std::is_same_v<W, R> || std::is_same_v<W, float>, "stored as the rounding's type or as float32");
  constexpr bool ROUND_IN_FLOAT = std::is_same_v<R, at::BFloat16> && std::is_same_v<W, float>;
  float scale;
  std::memcpy(&scale, row + D, sizeof scale);
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= D; d += 16) {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d));
    __m512 values = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), _mm512_set1_ps(scale));
    if constexpr (ROUND_IN_FLOAT) values = _mm512_castsi512_ps(round_to_bf16(values));
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<W, at::BFloat16>)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), (__m256i)_mm512_cvtneps_pbh(values));
    else
#endif
      store16f(out + d, values);
  }
#elif defined(__AVX2__)
  for (; d + 8 <= D; d += 8) {
    const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d));
    __m256 values = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), _mm256_set1_ps(scale));
    if constexpr (ROUND_IN_FLOAT) values = _mm256_castsi256_ps(round_to_bf16(values));
    store8(out + d, values);
  }
#endif
  for (; d < D; ++d)  // c10 rounds to nearest even
    out[d] = static_cast<W>(static_cast<R>(static_cast<float>(row[d]) * scale));
}

// The pairs of activation and KV cache dtypes the attention kernels take: both bfloat16, both float32,
// float32 activations over a bfloat16 cache (--kv-cache-dtype bfloat16: half the bytes per token), or
// either over an fp8 e5m2 or int8 cache (--kv-cache-dtype fp8_e5m2 or int8: a byte per value)
inline bool attention_takes(at::ScalarType activations, at::ScalarType cache) {
  const bool same = activations == cache && (cache == at::kBFloat16 || cache == at::kFloat);
  const bool byte = (cache == at::kFloat8_e5m2 || cache == at::kChar) &&
                    (activations == at::kBFloat16 || activations == at::kFloat);
  return same || byte || (activations == at::kFloat && cache == at::kBFloat16);
}

// f(T{}, KV{}) for one of those pairs
template <typename F>
decltype(auto) with_attention_types(at::ScalarType activations, at::ScalarType cache, F&& f) {
  TORCH_CHECK(attention_takes(activations, cache),
              "attention takes bfloat16 or float32 activations over a KV cache of their dtype, of float8_e5m2 "
              "or of int8, or float32 over bfloat16; got ", activations, " over ", cache);
  if (cache == at::kFloat) return f(float{}, float{});
  if (cache == at::kFloat8_e5m2)
    return activations == at::kBFloat16 ? f(at::BFloat16{}, at::Float8_e5m2{}) : f(float{}, at::Float8_e5m2{});
  if (cache == at::kChar)
    return activations == at::kBFloat16 ? f(at::BFloat16{}, int8_t{}) : f(float{}, int8_t{});
  if (activations == at::kBFloat16) return f(at::BFloat16{}, at::BFloat16{});
  return f(float{}, at::BFloat16{});
}

// The head sizes the attention kernels compile as constants (others take their generic path).
#define NANOSERVE_FOR_EACH_HEAD_DIM(CASE) CASE(32) CASE(64) CASE(80) CASE(96) CASE(128) CASE(256)

// How decode attention shares its work: a task per (sequence, KV head) and, with fewer tasks than threads
// can share, each long context cut into `parts` of part_tokens positions, merged at the end.
struct AttentionSplit {
  int64_t tasks, parts, part_tokens;
  // each (task, part)'s running max, total and sum of V rows, for every query head
  int64_t scratch_floats(int64_t heads_per_kv, int64_t head_dim) const {
    return tasks * parts * heads_per_kv * (head_dim + 2);
  }
};
// the first position a sequence of seq_len tokens attends to: 0, or the start of its window
inline int64_t first_attended(int64_t seq_len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
}
AttentionSplit attention_split(const int64_t* seq_lens, int64_t num_seqs, int64_t num_kv_heads, int64_t window);
// The sizes behind decode attention's q [S, H, D], KV cache [2, Hkv, num_blocks, block_size, row] and block
// table [S, max_blocks]
// (row: a cached row's elements, D, or D + INT8_SCALE_BYTES for int8)
struct DecodeAttentionShape {
  int64_t num_heads, num_kv_heads, head_dim, num_blocks, block_size, max_blocks;
};
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
torch::Tensor soft_cap_logits(torch::Tensor logits, double cap);
bool quant_matmul_supported();
// How many bytes of codes ahead of the group it reads quant_matmul prefetches a weight (0: it does not), for
// the whole process: on a Zen 1, 4096 made batch-1 steps faster than 2048 or 8192; on a Zen 3, 1024 or 1536
// took 0.95x the time of 4096 (nanoserve.model.prefetch_choice measures it per CPU).
int64_t weight_prefetch_bytes();
void set_weight_prefetch_bytes(int64_t bytes);
torch::Tensor quant_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t bits);
// whether quant_matmul's scales (this many float16 values, for a k x n weight) hold a low beside each scale;
// raises where they fit neither layout
bool quant_scales_have_lows(int64_t scale_count, int64_t k, int64_t n, int64_t bits);
torch::Tensor dense_matmul(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias);
// oneDNN's matmul over a weight packed by torch.ops.mkldnn._reorder_linear_weight; _by_rows: each thread its
// own share of the rows, on one thread (packed_linear.cpp)
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor packed_linear_by_rows(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                                 int64_t out_features);

// quant_matmul's layout (quant_matmul.cpp): groups of 32 inputs, tiles of 16 output columns.
namespace quant_isa {
constexpr int64_t GROUP = 32;
constexpr int64_t TILE = 16;

#if defined(__AVX2__)
// The codes and scales of the group `distance` bytes of codes ahead, into L1: the hardware prefetchers alone
// left the tile loops waiting on memory. Both loops were measured reading weights of SmolLM2's shapes
// cold, one row, 2 threads, with and without it: on a Zen 1 (AVX2; 22.6 GB/s) one pass over both halves
// and the prefetch took gate_up from 9.6 to 13-14 GB/s and a batch-1 decode step to 0.82x the time; on
// an AVX-512 Xeon gate_up went from 42 to 48 GB/s, down from 42 to 46 and the 8-bit lm_head from 44 to 51.
// How far ahead pays best differs by CPU (weight_prefetch_bytes).
template <int BITS, bool LOWS>
inline void prefetch_group_ahead(const uint8_t* codes, const at::Half* scales, int64_t distance) {
  constexpr int64_t group_bytes = GROUP * TILE * BITS / 8;
  constexpr int64_t scale_bytes = (LOWS ? 2 : 1) * TILE * sizeof(at::Half);
  for (int64_t line = 0; line < group_bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(codes) + distance + line, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scales) + distance / group_bytes * scale_bytes, _MM_HINT_T0);
}
#endif
}  // namespace quant_isa

// The activations' int8 copy, per-group scales and sums: rows * k, rows * k / 32 and rows * k / 32.
struct QuantScratch {
  int8_t* xq;
  float* scales;
  float* sums;
};

// The decode step's kernels over raw bf16 or float32 buffers (T), for FusedDecoder's one-region step
// (work_split.h): the same code as the tensor entry points, without their allocations and checks, so that
// every thread of the region can call them; the caller checks the shapes.
namespace raw {
template <typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t rows, int64_t hidden, float eps);
// RMSNorm over each query head (q_norm) and key head (k_norm) of qkv [tokens, (H + 2 Hkv) * D], in place
template <typename T>
void norm_heads(T* qkv, const T* q_norm, const T* k_norm, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                int64_t head_dim, float eps);
// sum = a + b (rounded to T), out = rms_norm(sum) by weight; sum may be a
template <typename T>
void add_rms_norm(const T* a, const T* b, T* sum, const T* weight, T* out, int64_t rows, int64_t hidden, float eps);
// x [rows, width] += bias, rounded as torch's add rounds
template <typename T>
void add_bias(T* x, const T* bias, int64_t rows, int64_t width);
// rope_write_kv's grain: up to this many tokens, thread 0 alone rotates them and writes their K and V rows
constexpr int64_t ROPE_GRAIN_TOKENS = 4;
template <typename T, typename KV>
void rope_write_kv(const T* qkv, const T* cos_sin, T* q, KV* cache, const int64_t* slots, int64_t tokens,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim,
                   int64_t slots_per_head);
template <typename T>
void act_and_mul(bool gelu, const T* x, T* out, int64_t rows, int64_t width);
template <typename T>
void quant_matmul(const T* x, int64_t rows, int64_t k, const uint8_t* codes, const at::Half* scales, int64_t bits,
                  bool lows, int64_t n, const QuantScratch& scratch, T* out);
// x [rows, k] @ weight [n, k].T -> out [rows, n], float32 throughout
void dense_matmul(const float* x, int64_t rows, int64_t k, const float* weight, int64_t n, float* out);
// paged_decode_attention into out [S, H * D], with the split's scratch
template <typename T, typename KV>
void decode_attention(const T* q, const KV* kv_cache, const int32_t* block_table, const int64_t* seq_lens,
                      const DecodeAttentionShape& shape, double scale, int64_t window, double softcap,
                      const AttentionSplit& split, float* scratch, T* out);
}  // namespace raw

torch::Tensor sample_rows(torch::Tensor logits, const std::vector<float>& temperature,
                          const std::vector<int64_t>& top_k, const std::vector<float>& top_p,
                          const std::vector<float>& min_p, torch::Tensor uniforms);
torch::Tensor greedy_rows(torch::Tensor logits);

void register_fused_decoder(pybind11::module& m);
