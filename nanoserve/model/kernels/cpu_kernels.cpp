// CPU kernels for the steps where PyTorch's eager ops cost more in dispatch and copies than in work.
//
// paged_decode_attention: one query token per sequence, grouped-query heads, straight from the paged KV
// cache (q.k products in bf16 pairs with AVX512-BF16 where the head size is a multiple of 32, else 8 keys at
// a time on AVX2). Each (sequence, KV head) pair is one task that walks the context 64 positions at a time:
// its query heads' scores for those positions, block by block, then a running softmax over all 64 (max and
// total rescaled when the max grows), then the weighted sum of their V rows (on AVX-512, each V row widened
// once for up to 4 query heads). Each cached K and V row is read once, in place. With fewer tasks than
// threads can share (3 KV heads on 2 threads at batch 1), contexts of 64 tokens and more are split into
// parts whose results are merged, so that no thread waits for another's second task. A sliding window
// starts the walk at the window's first position (blocks before it may be freed); soft-capping maps each
// score to cap * tanh(score / cap) (Gemma 2). An fp8 e5m2 cache (a byte a value) is widened as it
// is read: V rows to float32 by way of float16, K rows to bf16 for the pair dot products. An int8 cache's
// rows (codes and a scale) are dequantized a block at a time into what the bf16 or float32 paths read.
//
// rms_norm: one pass per row in float32, where PyTorch's CPU rms_norm is a chain of eight ops.
//
// rope_write_kv: rotary embedding of q and k straight out of the fused qkv projection, k and v written
// to the cache on the way: one pass where PyTorch needs slices, a roll, a multiply and an addcmul.
//
// silu_and_mul, gelu_tanh_and_mul: act(gate) * up over the fused gate/up projection, one pass instead of
// three ops.
//
// add_rms_norm: the residual add and the next norm in one pass (the fused decode step's).
//
// soft_cap_logits: cap * tanh(logit / cap) in place, one vectorized pass (Gemma 2's final logits), where
// torch's div, tanh and mul took 2-3 ms over a batch-32 step's logits on a Zen 5.
//
// paged_prefill_attention (prefill_attention.cpp): several new tokens per sequence, causal, from the cache.
// quant_matmul (quant_matmul.cpp): group-quantized weights times int8-quantized activations, for decode.
// sample_rows (sampling.cpp): temperature, top-k, top-p and min-p sampling, a row per task; greedy_rows: the
// argmax of each row.
// FusedDecoder (fused_decoder.cpp): a whole decode step of the Llama- and Gemma-shaped families and the
// mixtures of experts, kernel after kernel.
#include "kernels.h"
#include "vec16.h"
#include "work_split.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

#if defined(__AVX512BF16__)
// lane t: the sum of v[t]'s 16 lanes, by a tree of unpacks and lane shuffles (45 instructions for the 16
// sums, where one horizontal sum takes 8)
inline __m512 sum_each16(const __m512 v[16]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  auto fold = [](__m512 a, __m512 b) {  // 128-bit lanes (a0 + a1, a2 + a3, b0 + b1, b2 + b3)
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  for (int i = 0; i < 2; ++i) halves[i] = fold(quads[2 * i], quads[2 * i + 1]);
  return fold(halves[0], halves[1]);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// lane t: the sum of v[t]'s 8 lanes (two rounds of pairwise sums, then the 128-bit halves)
inline __m256 sum_each8(const __m256 v[8]) {
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

// score_rows on AVX2: 8 keys' dot products with one query head in 8 registers, then their 8 sums in one
template <typename T, int D>
inline void score_rows_avx2(const T* k, int64_t n, int64_t per_kv, const float* query, float* scores,
                            int64_t stride) {
  for (int64_t first = 0; first < n; first += 8, k += 8 * D) {
    const int64_t keys = std::min<int64_t>(8, n - first);
    const T* rows[8];  // past the block's end, its last row again: computed, never stored
    for (int64_t t = 0; t < 8; ++t) rows[t] = k + std::min(t, keys - 1) * D;
    for (int64_t h = 0; h < per_kv; ++h) {
      const float* qh = query + h * D;
      __m256 dots[8];
      for (int t = 0; t < 8; ++t) dots[t] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {  // 8 chains of FMAs side by side: one alone waits on each step
        const __m256 qd = _mm256_loadu_ps(qh + d);
        for (int t = 0; t < 8; ++t) dots[t] = _mm256_fmadd_ps(load8(rows[t] + d), qd, dots[t]);
      }
      _mm256_storeu_ps(scores + h * stride + first, sum_each8(dots));
    }
  }
}

// acc[d] += the sum over t < n of p[t] * v[t * D + d]: up to 64 columns a pass, their sums in 8 registers
template <int D>
inline void add_weighted_rows_avx2(const float* p, const float* v, int64_t n, float* acc) {
  constexpr int PASS = 64;
  for (int c = 0; c < D; c += PASS) {
    const int regs = std::min(PASS, D - c) / 8;
    __m256 sum[PASS / 8];
    for (int j = 0; j < regs; ++j) sum[j] = _mm256_loadu_ps(acc + c + 8 * j);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 weight = _mm256_broadcast_ss(p + t);
      for (int j = 0; j < regs; ++j) sum[j] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + t * D + c + 8 * j), sum[j]);
    }
    for (int j = 0; j < regs; ++j) _mm256_storeu_ps(acc + c + 8 * j, sum[j]);
  }
}
#endif

#if defined(__AVX512F__)
// acc[h * D + d] += the sum over t < n of p[h * stride + t] * v[t * D + d] for G query heads, columns FIRST to
// FIRST + 64 (then the next 64): each V row is widened to float32 once for all G heads, whose sums stay in
// registers across the block
template <typename T, int D, int G, int FIRST = 0>
inline void add_weighted_heads_avx512(const float* p, int64_t stride, const T* v, int64_t n, float* acc) {
  constexpr int REGS = std::min(64, D - FIRST) / 16;
  __m512 sum[G][REGS];
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < REGS; ++j) sum[h][j] = _mm512_loadu_ps(acc + h * D + FIRST + 16 * j);
  for (int64_t t = 0; t < n; ++t) {
    __m512 row[REGS];
    for (int j = 0; j < REGS; ++j) row[j] = load16f(v + t * D + FIRST + 16 * j);
    for (int h = 0; h < G; ++h) {
      const __m512 weight = _mm512_set1_ps(p[h * stride + t]);
      for (int j = 0; j < REGS; ++j) sum[h][j] = _mm512_fmadd_ps(weight, row[j], sum[h][j]);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < REGS; ++j) _mm512_storeu_ps(acc + h * D + FIRST + 16 * j, sum[h][j]);
  if constexpr (FIRST + 64 < D) add_weighted_heads_avx512<T, D, G, FIRST + 64>(p, stride, v, n, acc);
}
#endif

// acc[d] += the sum over t < n of p[t] * v[t * D + d], for one query head and the n V rows of a block
template <int FIXED_D>
inline void add_weighted_rows(const float* p, const float* v, int64_t n, int64_t D, float* acc) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (FIXED_D > 0 && FIXED_D % 8 == 0) {
    add_weighted_rows_avx2<FIXED_D>(p, v, n, acc);
    return;
  }
#endif
  if constexpr (FIXED_D > 0) {  // the head's sums in registers across the block
    float sum[FIXED_D > 0 ? FIXED_D : 1];
    for (int64_t d = 0; d < D; ++d) sum[d] = acc[d];
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < D; ++d) sum[d] += p[t] * v[t * D + d];
    for (int64_t d = 0; d < D; ++d) acc[d] = sum[d];
  } else {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < D; ++d) acc[d] += p[t] * v[t * D + d];
  }
}

// out[i] = v[i] as float32 for the i < count values of a block's rows (the AVX2 path: 8 at a time)
template <typename T>
inline void widen_rows(const T* v, int64_t count, float* out) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, load8(v + i));
#endif
  for (; i < count; ++i) out[i] = to_float(v[i]);
}

// scores[h * stride + t] = scale * q_h . k_t for the n cached K rows of one block (query: q * scale); the AVX2
// path also writes up to 7 lanes past n
template <typename T, typename KV, int FIXED_D>
inline void score_rows(const KV* k, int64_t n, int64_t D, int64_t per_kv, const T* q, const float* query,
                       float scale, float* row, float* scores, int64_t stride) {
#if defined(__AVX512BF16__)
  constexpr bool FP8 = std::is_same_v<KV, at::Float8_e5m2>;
  if constexpr (std::is_same_v<T, at::BFloat16> && (std::is_same_v<KV, at::BFloat16> || FP8) && FIXED_D > 0 &&
                FIXED_D % 32 == 0) {  // bf16 pairs from the cache (fp8 rows widened to bf16 16 keys at a time)
    constexpr int PAIRS = FIXED_D / 32;  // registers of 32 bf16 a row
    alignas(64) at::BFloat16 widened[FP8 ? 16 * FIXED_D : 1];
    for (int64_t first = 0; first < n; first += 16, k += 16 * FIXED_D) {  // 16 keys' dot products, then their sums
      const int64_t keys = std::min<int64_t>(16, n - first);
      const at::BFloat16* key_rows;
      if constexpr (FP8) {
        widen_to_bf16(k, widened, keys * FIXED_D);
        key_rows = widened;
      } else {
        key_rows = k;
      }
      for (int64_t h = 0; h < per_kv; ++h) {
        __m512bh q_pairs[PAIRS];
        for (int i = 0; i < PAIRS; ++i) q_pairs[i] = (__m512bh)_mm512_loadu_si512(q + h * FIXED_D + 32 * i);
        __m512 dots[16];
        for (int64_t t = 0; t < 16; ++t) {
          dots[t] = _mm512_setzero_ps();
          if (t >= keys) continue;  // rows past the block's end are never read
          for (int i = 0; i < PAIRS; ++i) {
            const __m512bh key = (__m512bh)_mm512_loadu_si512(key_rows + t * FIXED_D + 32 * i);
            dots[t] = _mm512_dpbf16_ps(dots[t], q_pairs[i], key);
          }
        }
        const __m512 sums = _mm512_mul_ps(sum_each16(dots), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(scores + h * stride + first, static_cast<__mmask16>((1u << keys) - 1), sums);
      }
    }
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (FIXED_D > 0 && FIXED_D % 8 == 0) {
    score_rows_avx2<KV, FIXED_D>(k, n, per_kv, query, scores, stride);
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t, k += D) {
    for (int64_t d = 0; d < D; ++d) row[d] = to_float(k[d]);
    for (int64_t h = 0; h < per_kv; ++h) {
      const float* qh = query + h * D;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += qh[d] * row[d];
      scores[h * stride + t] = dot;
    }
  }
}

constexpr int64_t PREFETCH_BLOCKS = 4;
constexpr int64_t PREFETCH_PIECES = 2;  // calls a block: one before its scores, one before its V rows
constexpr int64_t MIN_PART_TOKENS = 32;
constexpr int64_t CHUNK_TOKENS = 64;

template <typename T, typename KV, int FIXED_D>
void decode_attention_for_head_dim(const T* q, const KV* kv, const int32_t* block_table, const int64_t* seq_lens,
                                   const DecodeAttentionShape& shape, float scale, int64_t window, float softcap,
                                   const AttentionSplit& split, float* scratch, T* out) {
  const int64_t num_heads = shape.num_heads, num_kv_heads = shape.num_kv_heads, num_blocks = shape.num_blocks;
  const int64_t block_size = shape.block_size, max_blocks = shape.max_blocks;
  // a head size known at compile time lets the compiler unroll and vectorize every row loop
  const int64_t D = FIXED_D > 0 ? FIXED_D : shape.head_dim;
  const int64_t per_kv = num_heads / num_kv_heads;
  // an int8 cache's rows (codes and a scale) are dequantized a block at a time into Rows, which the scores
  // and the weighted sums read as they read a bf16 (or float32) cache
  constexpr bool INT8 = std::is_same_v<KV, int8_t>;
#if defined(__AVX512BF16__)
  using Dequantized = T;  // bf16 rows for the pair dot products
#else
  using Dequantized = float;  // rounded to T, then read as they are: no widening after
#endif
  using Rows = std::conditional_t<INT8, Dequantized, KV>;
  const int64_t cached_row = cache_row<KV>(D);
  const int64_t head_stride = num_blocks * block_size * cached_row;
  const int64_t v_offset = num_kv_heads * head_stride;  // kv[1] - kv[0]
  auto first_position = [&](int64_t seq) { return first_attended(seq_lens[seq], window); };
  const int64_t tasks = split.tasks, parts = split.parts, part_tokens = split.part_tokens;
  // per (task, part): the running max and total of each query head, and its unnormalized sum of V rows
  float* part_max = scratch;
  float* part_total = part_max + tasks * parts * per_kv;
  float* part_acc = part_total + tasks * parts * per_kv;

  split_work(0, tasks * parts, 1, [&](int64_t begin, int64_t end) {
    // the positions [start, stop) an item covers
    auto item_start = [&](int64_t item) { return first_position(item / parts / num_kv_heads) + item % parts * part_tokens; };
    auto item_stop = [&](int64_t item) {
      return std::min(seq_lens[item / parts / num_kv_heads], item_start(item) + part_tokens);
    };
    // A sequence's blocks sit anywhere in the cache, each too short for the hardware prefetcher to pick up:
    // a cursor asks for them PREFETCH_BLOCKS blocks ahead of the one being read, through this thread's items
    // one after another, into L2. It asks for each block in PREFETCH_PIECES pieces, one as the block's scores
    // start and one as its V rows do: a whole block at once fills the core's queue of misses, and the
    // arithmetic behind the burst waits for memory instead of overlapping it. On a two-core AMD EPYC Zen 4,
    // 32 sequences over 160 cached tokens took 5.5-5.7 ms a step (30 layers) where whole blocks took 7.5-7.8
    // into L1 and 6.8 into L2, and pieces into L1 7.6. Inlined by force: GCC counts a prefetch as no effect,
    // and would drop a call to a function that does nothing else.
    const int64_t block_bytes = block_size * cached_row * int64_t(sizeof(KV));
    const int64_t piece_bytes = (block_bytes / PREFETCH_PIECES + 63) / 64 * 64;
    int64_t ahead_item = begin, ahead_block = begin < end ? item_start(begin) / block_size : 0, ahead_byte = 0;
    int64_t blocks_asked = 0, blocks_read = 0;  // counted along this thread's items
    auto prefetch_piece = [&]() __attribute__((always_inline)) {
      while (ahead_item < end && blocks_asked < blocks_read + PREFETCH_BLOCKS) {
        if (ahead_block * block_size >= item_stop(ahead_item)) {
          if (++ahead_item < end) ahead_block = item_start(ahead_item) / block_size;
          continue;
        }
        const int64_t task = ahead_item / parts, seq = task / num_kv_heads, kv_head = task % num_kv_heads;
        const int64_t offset =
            kv_head * head_stride + block_table[seq * max_blocks + ahead_block] * block_size * cached_row;
        const char* k = reinterpret_cast<const char*>(kv + offset);
        const char* v = reinterpret_cast<const char*>(kv + offset + v_offset);
        const int64_t piece_end = std::min(block_bytes, ahead_byte + piece_bytes);
        for (int64_t byte = ahead_byte; byte < piece_end; byte += 64) {
          __builtin_prefetch(k + byte, 0, 2);
          __builtin_prefetch(v + byte, 0, 2);
        }
        ahead_byte = piece_end;
        if (ahead_byte == block_bytes) {
          ahead_byte = 0;
          ++ahead_block;
          ++blocks_asked;
        }
        return;
      }
    };
    for (int64_t i = 0; i < PREFETCH_BLOCKS * PREFETCH_PIECES; ++i) prefetch_piece();
    // scores: each query head's for a chunk of positions, with room for 16 lanes past its end
    constexpr int64_t stride = CHUNK_TOKENS + 16;
    std::vector<float> query(per_kv * D), scores(per_kv * stride), row(D), rows(block_size * D);
    std::vector<Rows> dequantized(INT8 ? block_size * D : 0);
    // the n cached rows from first, as the scores and sums read them: in place, or an int8 cache's dequantized
    auto block_rows = [&](const KV* first, int64_t n) -> const Rows* {
      if constexpr (INT8) {
        for (int64_t t = 0; t < n; ++t) dequantize_int8_row<T>(first + t * cached_row, D, dequantized.data() + t * D);
        return dequantized.data();
      } else {
        return first;
      }
    };
    for (int64_t item = begin; item < end; ++item) {
      const int64_t task = item / parts, seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t start = item_start(item), stop = item_stop(item);
      const T* q_seq = q + (seq * num_heads + kv_head * per_kv) * D;
      for (int64_t i = 0; i < per_kv * D; ++i) query[i] = to_float(q_seq[i]) * scale;
      float* acc = part_acc + item * per_kv * D;
      float* max_score = part_max + item * per_kv;
      float* total = part_total + item * per_kv;
      std::fill(acc, acc + per_kv * D, 0.f);
      std::fill(max_score, max_score + per_kv, -INFINITY);
      std::fill(total, total + per_kv, 0.f);
      const KV* k_head = kv + kv_head * head_stride;
      const KV* v_head = k_head + v_offset;
      // f(slot, offset, n) for the chunk's runs of positions within one cache block: the first one's cache
      // slot, its offset in the chunk and the run's length
      auto for_each_run = [&](int64_t chunk_start, int64_t chunk_stop, auto f) __attribute__((always_inline)) {
        for (int64_t position = chunk_start; position < chunk_stop;) {
          const int64_t block = block_table[seq * max_blocks + position / block_size];
          const int64_t n = std::min(block_size - position % block_size, chunk_stop - position);
          f(block * block_size + position % block_size, position - chunk_start, n);
          position += n;
        }
      };
      // a chunk at a time: its scores, a running softmax (max and total rescaled per chunk), its V rows
      for (int64_t chunk_start = start; chunk_start < stop; chunk_start += CHUNK_TOKENS) {
        const int64_t chunk_stop = std::min(stop, chunk_start + CHUNK_TOKENS), count = chunk_stop - chunk_start;
        for_each_run(chunk_start, chunk_stop, [&](int64_t slot, int64_t offset, int64_t n) {
          ++blocks_read;
          prefetch_piece();
          score_rows<T, Rows, FIXED_D>(block_rows(k_head + slot * cached_row, n), n, D, per_kv, q_seq, query.data(),
                                       scale, row.data(), scores.data() + offset, stride);
        });
        for (int64_t h = 0; h < per_kv; ++h) {
          float* s = scores.data() + h * stride;
          // lanes up to the next 16: -inf, which the max passes over and exp turns to 0
          const int64_t padded = (count + 15) / 16 * 16;
          if (softcap > 0.f) soft_cap(s, padded, 1.f / softcap, softcap);
          std::fill(s + count, s + padded, -INFINITY);
          const float chunk_max = std::max(max_score[h], max_of(s, padded));
          if (chunk_max > max_score[h]) {
            const float shrink = std::exp(max_score[h] - chunk_max);
            total[h] *= shrink;
            float* a = acc + h * D;
            for (int64_t d = 0; d < D; ++d) a[d] *= shrink;
            max_score[h] = chunk_max;
          }
          total[h] += exp_shifted(s, padded, chunk_max);
        }
        for_each_run(chunk_start, chunk_stop, [&](int64_t slot, int64_t offset, int64_t n) {
          prefetch_piece();
          const Rows* v = block_rows(v_head + slot * cached_row, n);
#if defined(__AVX512F__)
          if constexpr (FIXED_D > 0 && FIXED_D % 16 == 0) {
            for (int64_t h = 0; h < per_kv; h += 4) {  // up to 4 heads' sums in registers at once
              const float* p = scores.data() + h * stride + offset;
              switch (std::min<int64_t>(4, per_kv - h)) {
                case 1: add_weighted_heads_avx512<Rows, FIXED_D, 1>(p, stride, v, n, acc + h * D); break;
                case 2: add_weighted_heads_avx512<Rows, FIXED_D, 2>(p, stride, v, n, acc + h * D); break;
                case 3: add_weighted_heads_avx512<Rows, FIXED_D, 3>(p, stride, v, n, acc + h * D); break;
                default: add_weighted_heads_avx512<Rows, FIXED_D, 4>(p, stride, v, n, acc + h * D);
              }
            }
            return;
          }
#endif
          const float* v_rows = rows.data();
          if constexpr (std::is_same_v<Rows, float>)
            v_rows = v;  // read in place
          else
            widen_rows(v, n * D, rows.data());
          for (int64_t h = 0; h < per_kv; ++h)
            add_weighted_rows<FIXED_D>(scores.data() + h * stride + offset, v_rows, n, D, acc + h * D);
        });
      }
    }
  });

  // each query head: its parts rescaled to the overall max, summed, normalized
  split_work(0, tasks * per_kv, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(D);
    for (int64_t head = begin; head < end; ++head) {
      const int64_t task = head / per_kv, h = head % per_kv;
      float overall = -INFINITY, total = 0.f;
      for (int64_t part = 0; part < parts; ++part)
        overall = std::max(overall, part_max[(task * parts + part) * per_kv + h]);
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t part = 0; part < parts; ++part) {
        const int64_t item = task * parts + part;
        if (part_total[item * per_kv + h] == 0.f) continue;  // a part beyond this sequence's context
        const float weight = std::exp(part_max[item * per_kv + h] - overall);
        total += part_total[item * per_kv + h] * weight;
        const float* a = part_acc + (item * per_kv + h) * D;
        for (int64_t d = 0; d < D; ++d) sum[d] += a[d] * weight;
      }
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      T* o = out + (seq * num_heads + kv_head * per_kv + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(sum[d] / total);
    }
  });
}

}  // namespace

AttentionSplit attention_split(const int64_t* seq_lens, int64_t num_seqs, int64_t num_kv_heads, int64_t window) {
  int64_t longest = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq)
    longest = std::max(longest, seq_lens[seq] - first_attended(seq_lens[seq], window));
  // Few (sequence, KV head) tasks would leave threads idle or waiting (3 KV heads on 2 threads at batch 1):
  // then contexts are split into parts, each with its own running softmax, merged at the end.
  const int64_t tasks = num_seqs * num_kv_heads, threads = at::get_num_threads();
  int64_t parts = 1;
  if (tasks < 2 * threads)
    parts = std::max<int64_t>(1, std::min((2 * threads + tasks - 1) / tasks, longest / MIN_PART_TOKENS));
  return {tasks, parts, (longest + parts - 1) / parts};
}

// q: [S, H, D]; kv_cache: [2, Hkv, num_blocks, block_size, row]; block_table: int32 [S, max_blocks];
// seq_lens: int64 [S] (context including the new token, already written to the cache); window: the last
// positions attended to (0: all); softcap: cap of cap * tanh(score / cap) (0: none) -> [S, H * D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                                     torch::Tensor seq_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_table.is_contiguous());
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt64);
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = kv_cache.size(1);
  auto out = torch::empty({num_seqs, num_heads * head_dim}, q.options());
  auto lens = seq_lens.contiguous();
  const AttentionSplit split = attention_split(lens.data_ptr<int64_t>(), num_seqs, num_kv_heads, window);
  std::vector<float> scratch(split.scratch_floats(num_heads / num_kv_heads, head_dim));
  const DecodeAttentionShape shape{num_heads, num_kv_heads, head_dim, kv_cache.size(2), kv_cache.size(3),
                                   block_table.size(1)};
  with_attention_types(q.scalar_type(), kv_cache.scalar_type(), [&](auto t, auto kv) {
    using T = decltype(t);
    using KV = decltype(kv);
    TORCH_CHECK(kv_cache.size(4) == cache_row<KV>(head_dim), "KV cache rows of ", kv_cache.size(4),
                " elements for a head size of ", head_dim);
    raw::decode_attention(q.data_ptr<T>(), kv_cache.data_ptr<KV>(), block_table.data_ptr<int32_t>(),
                          lens.data_ptr<int64_t>(), shape, scale, window, softcap, split, scratch.data(),
                          out.data_ptr<T>());
  });
  return out;
}

namespace {

// One call for the rows of both paths (noipa: neither inlined nor cloned for a caller's constant row count,
// so the same machine code sums the squares in the same order wherever it is called from, and a fused
// path's norms are the module path's bit for bit)
template <typename T>
__attribute__((noipa)) void norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t hidden,
                                      float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = x + r * hidden;
    float squares = 0.f;
    for (int64_t i = 0; i < hidden; ++i) squares += to_float(in[i]) * to_float(in[i]);
    const float inv_rms = 1.f / std::sqrt(squares / hidden + eps);
    T* o = out + r * hidden;  // may be x: each element is read before it is written
    for (int64_t i = 0; i < hidden; ++i) o[i] = static_cast<T>(to_float(in[i]) * inv_rms * to_float(weight[i]));
  }
}

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
  split_work(0, rows, 16, [&](int64_t begin, int64_t end) {
    norm_rows(x + begin * hidden, weight, out + begin * hidden, end - begin, hidden, eps);
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

namespace {

template <typename T>
void add_elements(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(to_float(a[i]) + to_float(b[i]));
}

// sum = a + b rounded to T (as torch's add rounds it), out = rms_norm(sum), a row at a time: the row's sum
// is normed while it is still in L1, where an add over all rows and then a norm over all rows read every
// row twice from further away and wait for each other at a barrier. sum may be a.
template <typename T>
void add_norm_rows(const T* a, const T* b, T* sum, const T* weight, T* out, int64_t rows, int64_t hidden,
                   float eps) {
  split_work(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      add_elements(a + r * hidden, b + r * hidden, sum + r * hidden, hidden);
      norm_rows(sum + r * hidden, weight, out + r * hidden, 1, hidden, eps);
    }
  });
}

}  // namespace

// x + delta rounded to x's dtype (as torch's add rounds it), and rms_norm of that sum: the residual add
// and the next norm of the module path, in one call.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight,
                                                      double eps) {
  TORCH_CHECK(x.dim() == 2 && x.sizes() == delta.sizes() && weight.dim() == 1 && x.size(1) == weight.size(0));
  TORCH_CHECK(x.scalar_type() == delta.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "x, delta and weight must share a dtype");
  auto a = x.contiguous(), b = delta.contiguous();
  auto sum = torch::empty_like(a), normed = torch::empty_like(a);
  if (a.scalar_type() == torch::kBFloat16) {
    add_norm_rows(a.data_ptr<at::BFloat16>(), b.data_ptr<at::BFloat16>(), sum.data_ptr<at::BFloat16>(),
                  weight.data_ptr<at::BFloat16>(), normed.data_ptr<at::BFloat16>(), a.size(0), a.size(1),
                  static_cast<float>(eps));
  } else {
    TORCH_CHECK(a.scalar_type() == torch::kFloat32, "bfloat16 or float32 only");
    add_norm_rows(a.data_ptr<float>(), b.data_ptr<float>(), sum.data_ptr<float>(), weight.data_ptr<float>(),
                  normed.data_ptr<float>(), a.size(0), a.size(1), static_cast<float>(eps));
  }
  return {sum, normed};
}

namespace {

// A head x with its first rotary_dim values rotated by cos and sin (the rest as they are) into dst, rounded
// to dst's dtype (a bf16 cache's K rows from float32 ones)
template <typename T, typename OUT>
inline void rotate_row(const T* x, const T* cos, const T* sin, OUT* dst, int64_t rotary_dim, int64_t head_dim) {
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i)  // two loops without a select: both vectorize
    dst[i] = static_cast<OUT>(to_float(x[i]) * to_float(cos[i]) + to_float(x[i + half]) * to_float(sin[i]));
  for (int64_t i = half; i < rotary_dim; ++i)
    dst[i] = static_cast<OUT>(to_float(x[i]) * to_float(cos[i]) + to_float(x[i - half]) * to_float(sin[i]));
  for (int64_t i = rotary_dim; i < head_dim; ++i) dst[i] = static_cast<OUT>(to_float(x[i]));
}

template <typename T, typename KV>
void rope_rows(const T* qkv, const T* cos_sin, T* q_out, KV* cache, const int64_t* slots, int64_t num_tokens,
               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim,
               int64_t slots_per_head) {
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t cached_row = cache_row<KV>(head_dim);
  split_work(0, num_tokens, raw::ROPE_GRAIN_TOKENS, [&](int64_t begin, int64_t end) {
    constexpr bool BYTES = std::is_same_v<KV, int8_t> || std::is_same_v<KV, at::Float8_e5m2>;
    std::vector<T> rotated(BYTES ? head_dim : 0);
    std::vector<float> values(rotated.size());
    for (int64_t t = begin; t < end; ++t) {
      const T* cos = cos_sin + t * 2 * rotary_dim;  // [cos, cos]
      const T* sin = cos + rotary_dim;              // [-sin, sin]
      const T* src = qkv + t * row;
      for (int64_t h = 0; h < num_heads + 2 * num_kv_heads; ++h) {
        const T* x = src + h * head_dim;
        if (h < num_heads) {
          rotate_row(x, cos, sin, q_out + (t * num_heads + h) * head_dim, rotary_dim, head_dim);
          continue;
        }
        const int64_t kv = h < num_heads + num_kv_heads ? 0 : 1, kv_head = (h - num_heads) % num_kv_heads;
        KV* dst = cache + ((kv * num_kv_heads + kv_head) * slots_per_head + slots[t]) * cached_row;
        if constexpr (BYTES) {  // from the values a T cache would hold, as PyTorch's path rounds them
          if (kv == 0) rotate_row(x, cos, sin, rotated.data(), rotary_dim, head_dim);
          const T* source = kv == 0 ? rotated.data() : x;
          for (int64_t i = 0; i < head_dim; ++i) values[i] = to_float(source[i]);
          if constexpr (std::is_same_v<KV, int8_t>) {
            quantize_int8_row(values.data(), head_dim, dst);
          } else {
            for (int64_t i = 0; i < head_dim; ++i) dst[i] = static_cast<KV>(values[i]);
          }
        } else if (kv == 0)
          rotate_row(x, cos, sin, dst, rotary_dim, head_dim);
        else if constexpr (std::is_same_v<T, KV>)
          std::memcpy(dst, x, head_dim * sizeof(T));
        else
          for (int64_t i = 0; i < head_dim; ++i) dst[i] = static_cast<KV>(x[i]);
      }
    }
  });
}

// e^-g capped at e^88 (float's largest power of e): under -ffast-math g / inf is g times an approximate
// reciprocal of inf refined by Newton's step, 0 * inf, so a gate below -88.7 gave NaN where torch gives -0.
inline float silu(float g) { return g / (1.f + std::exp(std::min(-g, 88.f))); }
inline float gelu_tanh(float g) {  // PyTorch's gelu(approximate="tanh")
  return 0.5f * g * (1.f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

template <typename T, float (*ACT)(float)>
void act_mul_rows(const T* x, T* out, int64_t rows, int64_t width) {
  split_work(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * width;
      const T* up = gate + width;
      T* o = out + r * width;
      for (int64_t i = 0; i < width; ++i) o[i] = static_cast<T>(ACT(to_float(gate[i])) * to_float(up[i]));
    }
  });
}

}  // namespace

// qkv: [T, (H + 2 Hkv) * D] contiguous; cos_sin: [T, 2, 1, R] contiguous (cos twice, then -sin and sin), R
// the dims rotated at the start of each head (D, or fewer for Phi-4-mini's partial rotation);
// kv_cache: [2, Hkv, num_blocks, block_size, row]; slot_mapping: int64 [T] -> rotated q [T, H, D].
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos_sin, torch::Tensor kv_cache,
                            torch::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.is_contiguous() && cos_sin.is_contiguous() && kv_cache.is_contiguous());
  TORCH_CHECK(cos_sin.scalar_type() == qkv.scalar_type());
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous());
  const int64_t num_tokens = qkv.size(0), head_dim = qkv.size(1) / (num_heads + 2 * num_kv_heads);
  const int64_t rotary_dim = cos_sin.size(-1);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim && rotary_dim % 2 == 0 &&
                  rotary_dim <= head_dim && cos_sin.numel() == num_tokens * 2 * rotary_dim,
              "rope_write_kv: cos/sin rows [T, 2, 1, R] of an even R up to the head size");
  auto q = torch::empty({num_tokens, num_heads, head_dim}, qkv.options());
  const int64_t slots_per_head = kv_cache.size(2) * kv_cache.size(3);
  with_attention_types(qkv.scalar_type(), kv_cache.scalar_type(), [&](auto t, auto kv) {
    using T = decltype(t);
    using KV = decltype(kv);
    TORCH_CHECK(kv_cache.size(4) == cache_row<KV>(head_dim), "KV cache rows of ", kv_cache.size(4),
                " elements for a head size of ", head_dim);
    rope_rows(qkv.data_ptr<T>(), cos_sin.data_ptr<T>(), q.data_ptr<T>(), kv_cache.data_ptr<KV>(),
              slot_mapping.data_ptr<int64_t>(), num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim,
              slots_per_head);
  });
  return q;
}

template <float (*ACT)(float)>
torch::Tensor act_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0);
  auto in = x.contiguous();
  const int64_t width = in.size(1) / 2;
  auto out = torch::empty({in.size(0), width}, in.options());
  if (in.scalar_type() == torch::kBFloat16) {
    act_mul_rows<at::BFloat16, ACT>(in.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), in.size(0), width);
  } else {
    TORCH_CHECK(in.scalar_type() == torch::kFloat32, "bfloat16 or float32 only");
    act_mul_rows<float, ACT>(in.data_ptr<float>(), out.data_ptr<float>(), in.size(0), width);
  }
  return out;
}

// x: [T, 2 * I] (gate, then up) -> act(gate) * up [T, I]
torch::Tensor silu_and_mul(torch::Tensor x) { return act_and_mul<silu>(x); }
torch::Tensor gelu_tanh_and_mul(torch::Tensor x) { return act_and_mul<gelu_tanh>(x); }

// logits: float32, contiguous, capped in place and returned
torch::Tensor soft_cap_logits(torch::Tensor logits, double cap) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() && logits.is_cpu() && cap > 0,
              "soft_cap_logits: contiguous float32 logits on the CPU and a positive cap");
  float* x = logits.data_ptr<float>();
  const float capf = static_cast<float>(cap), inner = 1.f / capf;
  const int64_t whole = logits.numel() / 16;
  at::parallel_for(0, whole, 1024, [&](int64_t begin, int64_t end) {
    soft_cap(x + begin * 16, (end - begin) * 16, inner, capf);
  });
  if (const int64_t rest = logits.numel() - whole * 16) {  // the last few, padded to 16 lanes
    float padded[16] = {};
    std::copy(x + whole * 16, x + logits.numel(), padded);
    soft_cap(padded, 16, inner, capf);
    std::copy(padded, padded + rest, x + whole * 16);
  }
  return logits;
}

namespace raw {

template <typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
  rms_norm_rows(x, weight, out, rows, hidden, eps);
}

template <typename T>
void norm_heads(T* qkv, const T* q_norm, const T* k_norm, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                int64_t head_dim, float eps) {
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
  split_work(0, tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* q = qkv + t * row;
      norm_rows(q, q_norm, q, num_heads, head_dim, eps);
      norm_rows(q + num_heads * head_dim, k_norm, q + num_heads * head_dim, num_kv_heads, head_dim, eps);
    }
  });
}

template <typename T>
void add_rms_norm(const T* a, const T* b, T* sum, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
  add_norm_rows(a, b, sum, weight, out, rows, hidden, eps);
}

template <typename T>
void add_bias(T* x, const T* bias, int64_t rows, int64_t width) {
  split_work(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < width; ++i) x[r * width + i] = static_cast<T>(to_float(x[r * width + i]) + to_float(bias[i]));
  });
}

template <typename T, typename KV>
void rope_write_kv(const T* qkv, const T* cos_sin, T* q, KV* cache, const int64_t* slots, int64_t tokens,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim,
                   int64_t slots_per_head) {
  rope_rows(qkv, cos_sin, q, cache, slots, tokens, num_heads, num_kv_heads, head_dim, rotary_dim, slots_per_head);
}

template <typename T>
void act_and_mul(bool gelu, const T* x, T* out, int64_t rows, int64_t width) {
  (gelu ? act_mul_rows<T, gelu_tanh> : act_mul_rows<T, silu>)(x, out, rows, width);
}

template <typename T, typename KV>
void decode_attention(const T* q, const KV* kv_cache, const int32_t* block_table, const int64_t* seq_lens,
                      const DecodeAttentionShape& shape, double scale, int64_t window, double softcap,
                      const AttentionSplit& split, float* scratch, T* out) {
  const float scale_f = static_cast<float>(scale), softcap_f = static_cast<float>(softcap);
  switch (shape.head_dim) {
#define NANOSERVE_HEAD_DIM(D)                                                                           \
  case D:                                                                                               \
    return decode_attention_for_head_dim<T, KV, D>(q, kv_cache, block_table, seq_lens, shape, scale_f, window, \
                                                   softcap_f, split, scratch, out);
    NANOSERVE_FOR_EACH_HEAD_DIM(NANOSERVE_HEAD_DIM)
#undef NANOSERVE_HEAD_DIM
    default:
      decode_attention_for_head_dim<T, KV, 0>(q, kv_cache, block_table, seq_lens, shape, scale_f, window, softcap_f,
                                              split, scratch, out);
  }
}

#define NANOSERVE_RAW_KERNELS(T)                                                                                 \
  template void rms_norm(const T*, const T*, T*, int64_t, int64_t, float);                                       \
  template void norm_heads(T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t, float);                   \
  template void add_rms_norm(const T*, const T*, T*, const T*, T*, int64_t, int64_t, float);                     \
  template void add_bias(T*, const T*, int64_t, int64_t);                                                        \
  template void act_and_mul(bool, const T*, T*, int64_t, int64_t);
NANOSERVE_RAW_KERNELS(at::BFloat16)
NANOSERVE_RAW_KERNELS(float)
#undef NANOSERVE_RAW_KERNELS

// the pairs of with_attention_types
#define NANOSERVE_ATTENTION_KERNELS(T, KV)                                                                          \
  template void rope_write_kv(const T*, const T*, T*, KV*, const int64_t*, int64_t, int64_t, int64_t, int64_t,      \
                              int64_t, int64_t);                                                                    \
  template void decode_attention(const T*, const KV*, const int32_t*, const int64_t*, const DecodeAttentionShape&,  \
                                 double, int64_t, double, const AttentionSplit&, float*, T*);
NANOSERVE_ATTENTION_KERNELS(at::BFloat16, at::BFloat16)
NANOSERVE_ATTENTION_KERNELS(float, float)
NANOSERVE_ATTENTION_KERNELS(float, at::BFloat16)
NANOSERVE_ATTENTION_KERNELS(at::BFloat16, at::Float8_e5m2)
NANOSERVE_ATTENTION_KERNELS(float, at::Float8_e5m2)
NANOSERVE_ATTENTION_KERNELS(at::BFloat16, int8_t)
NANOSERVE_ATTENTION_KERNELS(float, int8_t)
#undef NANOSERVE_ATTENTION_KERNELS

}  // namespace raw

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_write_kv", &rope_write_kv);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.def("soft_cap_logits", &soft_cap_logits);
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("paged_prefill_attention", &paged_prefill_attention);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("quant_matmul_supported", &quant_matmul_supported);
  m.def("quant_matmul", &quant_matmul);
  m.def("weight_prefetch_bytes", &weight_prefetch_bytes);
  m.def("set_weight_prefetch_bytes", &set_weight_prefetch_bytes);
  m.def("dense_matmul", &dense_matmul, pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"));
  m.def("packed_linear_by_rows", &packed_linear_by_rows, pybind11::arg("x"), pybind11::arg("packed"),
        pybind11::arg("bias"), pybind11::arg("out_features"));
  m.def("sample_rows", &sample_rows);
  m.def("greedy_rows", &greedy_rows);
  register_fused_decoder(m);
}
