// paged_prefill_attention: sequences with several new tokens each (a prompt, or a chunk of one), causal,
// grouped-query heads, K and V read in place from the paged cache.
//
// PyTorch's CPU attention either writes out every score or, with a mask, computes every (query, key)
// pair; a causal prompt needs only half of them, and a mask of each shape costs a pass of its own. Here
// each task is a tile of a sequence's queries with the query heads that share one KV head: a tile's rows
// read each key and value once per tile, converted to float32 once, and walk the keys a chunk at a time
// with a running softmax (max and total rescaled when the max grows), up to the tile's last position.
// Keys past a query's own position, or before its window, are masked out in the chunks that hold both.
// Tasks differ in cost (a later tile sees more keys), so they are handed out one at a time. Where the CPU
// has AVX512-BF16, bfloat16 scores and weighted sums are dot products of bf16 pairs (float32 sums), the
// probabilities rounded to bf16 for the second, as PyTorch's own flash attention does. For head sizes in
// multiples of 32 the rows then go 16 at a time with a row per lane: each key's scores against them are one
// vector, so the softmax runs down the lanes over blocks of up to 128 keys (no sums across lanes, one
// exponential per 16 scores), and the probabilities, turned back into rows, weigh the values. With a key
// per lane instead, the sums across lanes cost as much as the products: a row per lane is 1.8-2.0x faster
// at 512 tokens and 1.9x at 2048 (Zen 5, AVX-512 pair dot products). With AMX those products run on the
// tiles: 16 keys scored against 16 rows per tile instruction, 32 keys' values weighed per instruction and
// column tile (4.5x faster than the pair dot products at 512 tokens on a Xeon).
// An fp8 e5m2 cache's K and V are widened to bf16 (or float32), an int8 cache's dequantized, as each
// (sequence, KV head) is packed, so every path above reads them as it reads a bf16 cache.
#include "kernels.h"
#include "vec16.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t QUERY_TILE = 16;  // queries per task
constexpr int64_t KEY_CHUNK = 16;   // keys scored at once: a row's float32 scores fill a vec16
constexpr int PARTS = KEY_CHUNK / ROW_LANES;  // registers a row's scores take: 1 with AVX-512, 2 on AVX2
constexpr int64_t ROW_GROUP = 8 / PARTS;      // rows scored together: 8 independent chains of sums

struct Layout {
  int64_t num_heads, num_kv_heads, per_kv, head_stride, v_offset, block_size, max_blocks;
  int64_t cached_row;  // elements a cached row takes: the head size, and an int8 row's scale
};

// A sequence's keys and values for one KV head, a chunk of KEY_CHUNK positions at a time, a key per lane:
// - float32 (PAIRS false): keys transposed ([chunk][D] vectors), values as rows ([chunk][KEY_CHUNK][D]);
// - bf16 pairs (PAIRS true): keys as [chunk][D / 2] vectors of (k[2i], k[2i + 1]) per lane, values as
//   [chunk][KEY_CHUNK / 2][D] pairs (v[2j][d], v[2j + 1][d]), ready for pair dot products;
// - for a row per lane (key_rows set): the keys as they are in the cache, [chunk][KEY_CHUNK][D] bf16, in
//   place of the key pairs, and the value pairs.
struct PackedContext {
  int64_t first_chunk;
  std::vector<vec16> keys;
  std::vector<float> values;
  std::vector<ivec16> key_pairs;
  std::vector<uint16_t> key_rows;
  std::vector<uint32_t> value_pairs;
};

// T: the cache's type; an int8 cache's values are dequantized to the activations' type A, as PyTorch's
// attention reads them
template <bool PAIRS, typename A, typename T>
void pack_context(const T* kv, const int32_t* table, const Layout& L, int64_t D, int64_t kv_head, int64_t start,
                  int64_t stop, bool key_rows, PackedContext& packed) {
  packed.first_chunk = start / KEY_CHUNK;
  const int64_t chunks = (stop + KEY_CHUNK - 1) / KEY_CHUNK - packed.first_chunk;
  if constexpr (PAIRS) {  // one chunk more of zero values: a row per lane weighs values two chunks at a time
    if (key_rows)
      packed.key_rows.assign(chunks * KEY_CHUNK * D, 0);
    else
      packed.key_pairs.assign(chunks * D / 2, ivec16{});
    packed.value_pairs.assign((chunks + 1) * KEY_CHUNK / 2 * D, 0);
  } else {
    packed.keys.assign(chunks * D, vec16{});
    packed.values.assign(chunks * KEY_CHUNK * D, 0.f);
  }
  const T* k_head = kv + kv_head * L.head_stride;
  constexpr bool INT8 = std::is_same_v<T, int8_t>, FP8 = std::is_same_v<T, at::Float8_e5m2>;
  // a row's K and V as the packing reads them, where the cache's own rows will not do
  using Wide = std::conditional_t<PAIRS || std::is_same_v<A, at::BFloat16>, at::BFloat16, float>;
  std::vector<Wide> widened(INT8 || (PAIRS && FP8) ? 2 * D : 0);
  for (int64_t pos = start; pos < stop; ++pos) {  // the chunk's lanes before start stay zero, always masked
    const int64_t chunk = pos / KEY_CHUNK - packed.first_chunk, lane = pos % KEY_CHUNK;
    const T* k = k_head + (table[pos / L.block_size] * L.block_size + pos % L.block_size) * L.cached_row;
    const T* v = k + L.v_offset;
    if constexpr (INT8) {
      dequantize_int8_row<Wide>(k, D, widened.data());
      dequantize_int8_row<Wide>(v, D, widened.data() + D);
    }
    if constexpr (PAIRS) {
      // an fp8 cache's rows widened, an int8 one's dequantized, a bf16 one's in place
      const at::BFloat16 *k_bf16, *v_bf16;
      if constexpr (FP8) {
        widen_to_bf16(k, widened.data(), D);
        widen_to_bf16(v, widened.data() + D, D);
      }
      if constexpr (INT8 || FP8) {
        k_bf16 = widened.data();
        v_bf16 = widened.data() + D;
      } else {
        k_bf16 = k;
        v_bf16 = v;
      }
      if (key_rows) {
        std::memcpy(packed.key_rows.data() + (chunk * KEY_CHUNK + lane) * D, k_bf16, D * sizeof(uint16_t));
      } else {
        uint32_t pair;
        ivec16* keys = packed.key_pairs.data() + chunk * D / 2;
        for (int64_t i = 0; i < D / 2; ++i) {
          std::memcpy(&pair, k_bf16 + 2 * i, sizeof pair);
          keys[i][lane] = static_cast<int32_t>(pair);
        }
      }
      uint16_t* values = reinterpret_cast<uint16_t*>(packed.value_pairs.data() + (chunk * KEY_CHUNK / 2 + lane / 2) * D);
      for (int64_t d = 0; d < D; ++d) std::memcpy(values + 2 * d + lane % 2, v_bf16 + d, sizeof(uint16_t));
    } else {
      vec16* keys = packed.keys.data() + chunk * D;
      float* values = packed.values.data() + (chunk * KEY_CHUNK + lane) * D;
      if constexpr (INT8) {
        for (int64_t d = 0; d < D; ++d) {
          keys[d][lane] = to_float(widened[d]);
          values[d] = to_float(widened[D + d]);
        }
      } else {
        for (int64_t d = 0; d < D; ++d) {
          keys[d][lane] = to_float(k[d]);
          values[d] = to_float(v[d]);
        }
      }
    }
  }
}

// The largest divisor of v up to 8: column registers whose sums run together
constexpr int column_block(int v) {
  for (int b = 8; b > 1; --b)
    if (v % b == 0) return b;
  return 1;
}

// out[row] += the chunk's values weighted by p, for a head size known at compile time: a block of up to 8
// column registers at a time, its sums in registers, and even and odd keys in separate sums where the block
// is shorter than 8, so that at least 8 chains run at once
template <int FIXED_D>
inline void add_weighted_values(float* out, const vec16& p, const float* values, int64_t D) {
  if constexpr (FIXED_D > 0 && FIXED_D % ROW_LANES == 0) {
    constexpr int V = FIXED_D / ROW_LANES, BLOCK = column_block(V), SUMS = BLOCK < 8 ? 2 : 1;
    for (int block = 0; block < V; block += BLOCK) {
      float* o = out + block * ROW_LANES;
      row_lanes sums[SUMS][BLOCK];
      for (int c = 0; c < BLOCK; ++c) {
        sums[0][c] = load_row_lanes(o + c * ROW_LANES);
        for (int k = 1; k < SUMS; ++k) sums[k][c] = row_lanes{};
      }
      for (int t = 0; t < KEY_CHUNK; t += SUMS)
        for (int k = 0; k < SUMS; ++k) {
          const float weight = p[t + k];
          const float* v = values + (t + k) * FIXED_D + block * ROW_LANES;
          for (int c = 0; c < BLOCK; ++c) sums[k][c] += weight * load_row_lanes(v + c * ROW_LANES);
        }
      for (int c = 0; c < BLOCK; ++c) {
        row_lanes total = sums[0][c];
        for (int k = 1; k < SUMS; ++k) total += sums[k][c];
        std::memcpy(o + c * ROW_LANES, &total, sizeof total);
      }
    }
  } else {
    for (int64_t t = 0; t < KEY_CHUNK; ++t)
      for (int64_t d = 0; d < D; ++d) out[d] += p[t] * values[t * D + d];
  }
}

#if defined(__AVX512BF16__)
constexpr bool HAS_PAIR_DOTS = true;

// scores[g] = the row's bf16 pairs dotted with each key's, for ROW_GROUP rows at once (even and odd pairs
// in separate sums: twice the chains in flight)
template <int FIXED_D>
inline void score_pairs(const uint32_t* query, const ivec16* keys, vec16 scores[ROW_GROUP]) {
  __m512 even[ROW_GROUP], odd[ROW_GROUP];
  for (int g = 0; g < ROW_GROUP; ++g) even[g] = odd[g] = _mm512_setzero_ps();
  for (int i = 0; i < FIXED_D / 2; i += 2) {
    const __m512bh k_even = (__m512bh)(__m512i)keys[i], k_odd = (__m512bh)(__m512i)keys[i + 1];
    for (int g = 0; g < ROW_GROUP; ++g) {
      const uint32_t* row = query + g * FIXED_D / 2;
      even[g] = _mm512_dpbf16_ps(even[g], (__m512bh)_mm512_set1_epi32(row[i]), k_even);
      odd[g] = _mm512_dpbf16_ps(odd[g], (__m512bh)_mm512_set1_epi32(row[i + 1]), k_odd);
    }
  }
  for (int g = 0; g < ROW_GROUP; ++g) scores[g] = (vec16)_mm512_add_ps(even[g], odd[g]);
}

// Rows whose weighted sums run together: as many as keep 16 sums of 16 lanes in registers
constexpr int pair_rows(int D) { return D <= 32 ? 8 : D <= 64 ? 4 : D <= 128 ? 2 : 1; }

// out[r] += p[r] (rounded to bf16) times the chunk's values, as pair dot products, for pair_rows(D) rows
// at once: each value vector is loaded once for all of them, and their sums are independent chains
template <int FIXED_D>
inline void add_weighted_value_pairs(float* out, const vec16* p, const uint32_t* values) {
  constexpr int V = FIXED_D / 16, R = pair_rows(FIXED_D);
  alignas(32) uint32_t weights[R][KEY_CHUNK / 2];
  __m512 sums[R][V];
  for (int r = 0; r < R; ++r) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(weights[r]), (__m256i)_mm512_cvtneps_pbh((__m512)p[r]));
    for (int c = 0; c < V; ++c) sums[r][c] = _mm512_loadu_ps(out + r * FIXED_D + 16 * c);
  }
  for (int j = 0; j < KEY_CHUNK / 2; ++j)
    for (int c = 0; c < V; ++c) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(values + j * FIXED_D + 16 * c);
      for (int r = 0; r < R; ++r) sums[r][c] = _mm512_dpbf16_ps(sums[r][c], (__m512bh)_mm512_set1_epi32(weights[r][j]), v);
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(out + r * FIXED_D + 16 * c, sums[r][c]);
}

constexpr int64_t TILE_ROWS = 16;
constexpr float LOG2E = 1.44269504f;
constexpr int64_t KEY_BLOCK = 128;  // keys scored before they are weighed: the running softmax rescales per block

// 2^t to 8.6e-5 relative error, exact at whole t: 1 + a cubic for 2^f - 1 on [0, 1) (fitted to the
// relative error), scaled by 2^floor(t) in one instruction; t below -126 counts as -126 (2^-126: nothing
// beside 1). The probabilities it gives are rounded to bf16 (up to 3.9e-3) for the weighted sum, so
// Cephes' degree-6 e^x, which the softmax first used, spent 6 of its 13 instructions on digits that
// rounding drops.
inline __m512 pow2_for_bf16(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.07706708f), f, _mm512_set1_ps(0.22764765f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69511485f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// rows[i] lane j <-> rows[j] lane i: the 16 x 16 transpose of 32-bit lanes (pairs within each 128-bit
// lane, then pairs of pairs, then the 128-bit lanes)
inline void transpose16(__m512i rows[16]) {
  __m512i pairs[16], quads[16];
  for (int i = 0; i < 16; i += 2) {
    pairs[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    pairs[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    quads[i] = _mm512_unpacklo_epi64(pairs[i], pairs[i + 2]);
    quads[i + 1] = _mm512_unpackhi_epi64(pairs[i], pairs[i + 2]);
    quads[i + 2] = _mm512_unpacklo_epi64(pairs[i + 1], pairs[i + 3]);
    quads[i + 3] = _mm512_unpackhi_epi64(pairs[i + 1], pairs[i + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // quads[4j + m], 128-bit lane l: column 4l + m of rows 4j..4j+3
    const __m512i low_a = _mm512_shuffle_i32x4(quads[m], quads[4 + m], 0x44);
    const __m512i high_a = _mm512_shuffle_i32x4(quads[m], quads[4 + m], 0xee);
    const __m512i low_b = _mm512_shuffle_i32x4(quads[8 + m], quads[12 + m], 0x44);
    const __m512i high_b = _mm512_shuffle_i32x4(quads[8 + m], quads[12 + m], 0xee);
    rows[m] = _mm512_shuffle_i32x4(low_a, low_b, 0x88);
    rows[4 + m] = _mm512_shuffle_i32x4(low_a, low_b, 0xdd);
    rows[8 + m] = _mm512_shuffle_i32x4(high_a, high_b, 0x88);
    rows[12 + m] = _mm512_shuffle_i32x4(high_a, high_b, 0xdd);
  }
}

// Which of a tile's rows, a row per lane, see a key: at or before the row's position and, with a window,
// inside it
struct Visibility {
  __m512i position, window_edge;
  int64_t first_position, last_position, window;

  __mmask16 of(int64_t key) const {
    const __m512i k = _mm512_set1_epi32(static_cast<int32_t>(key));
    const __mmask16 seen = _mm512_cmple_epi32_mask(k, position);
    return window > 0 ? seen & _mm512_cmpgt_epi32_mask(k, window_edge) : seen;
  }
  // whether every row sees every key of [first, first + KEY_CHUNK)
  bool whole(int64_t first) const {
    return first + KEY_CHUNK - 1 <= first_position && (window == 0 || first > last_position - window);
  }
};

// The softmax of a tile's 16 rows over a block of keys, a row per lane: scores [key][row] (unscaled, as the
// products left them) -> probs [row][key] in bf16, with the running max and total updated and the sums in acc
// rescaled where a row's max grew. The keys of a last odd chunk's partner get zero weight.
template <int64_t D>
void softmax_block(float* scores, uint16_t* probs, float* acc, int64_t chunks, int64_t first_key,
                   const Visibility& visible, float scale, float softcap, bool rescale, __m512& max_score,
                   __m512& total) {
  const int64_t keys = chunks * KEY_CHUNK;
  if (softcap > 0.f) {  // capped scores replace the raw ones, already scaled
    soft_cap(scores, keys * TILE_ROWS, scale / softcap, softcap);
    scale = 1.f;
  }
  bool whole[KEY_BLOCK / KEY_CHUNK];
  __m512 block_max = _mm512_set1_ps(-FLT_MAX);
  for (int64_t c = 0; c < chunks; ++c) {
    whole[c] = visible.whole(first_key + c * KEY_CHUNK);
    for (int64_t t = 0; t < KEY_CHUNK; ++t) {
      const __m512 s = _mm512_load_ps(scores + (c * KEY_CHUNK + t) * TILE_ROWS);
      block_max = whole[c] ? _mm512_max_ps(block_max, s)
                           : _mm512_mask_max_ps(block_max, visible.of(first_key + c * KEY_CHUNK + t), block_max, s);
    }
  }
  // a row that sees none of the block keeps -FLT_MAX * scale at most: its weights stay zero
  const __m512 new_max = _mm512_max_ps(max_score, _mm512_mul_ps(block_max, _mm512_set1_ps(scale)));
  const __mmask16 grew = _mm512_cmp_ps_mask(new_max, max_score, _CMP_GT_OQ);
  if (rescale && grew) {
    const __m512 shrink = pow2_for_bf16(_mm512_mul_ps(_mm512_sub_ps(max_score, new_max), _mm512_set1_ps(LOG2E)));
    total = _mm512_mask_mul_ps(total, grew, total, shrink);
    alignas(64) float factor[TILE_ROWS];
    _mm512_store_ps(factor, shrink);
    for (int64_t r = 0; r < TILE_ROWS; ++r)
      if (grew >> r & 1)
        for (int64_t d = 0; d < D; d += 16)
          _mm512_storeu_ps(acc + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), _mm512_set1_ps(factor[r])));
  }
  max_score = new_max;
  // (even key, odd key) bf16 pairs per row: the two keys' 16 bf16 each, interleaved
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  // e^(score * scale - max) as 2^(score * scale * log2(e) - max * log2(e))
  const __m512 scale_log2e = _mm512_set1_ps(scale * LOG2E), max_log2e = _mm512_mul_ps(new_max, _mm512_set1_ps(LOG2E));
  __m512 sums[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};  // even and odd keys: two chains
  for (int64_t first = 0; first < keys; first += 2 * KEY_CHUNK) {  // a pair of chunks: one A tile of probs
    __m512i weights[16];
    for (int64_t j = 0; j < KEY_CHUNK; ++j) {
      __m512 e[2];
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t key = first + 2 * j + h;
        if (key >= keys) {
          e[h] = _mm512_setzero_ps();
          continue;
        }
        const __m512 t = _mm512_fmsub_ps(_mm512_load_ps(scores + key * TILE_ROWS), scale_log2e, max_log2e);
        e[h] = whole[key / KEY_CHUNK] ? pow2_for_bf16(t)
                                      : _mm512_maskz_mov_ps(visible.of(first_key + key), pow2_for_bf16(t));
        sums[h] = _mm512_add_ps(sums[h], e[h]);
      }
      weights[j] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
    }
    transpose16(weights);
    for (int64_t r = 0; r < TILE_ROWS; ++r) _mm512_store_si512(probs + r * KEY_BLOCK + first, weights[r]);
  }
  total = _mm512_add_ps(total, _mm512_add_ps(sums[0], sums[1]));
}

// The products of rows in lanes as pair dot products in AVX-512 registers (a CPU with AVX512-BF16 but no
// AMX): the same layouts as the tiles', the same roundings
struct PairDotProducts {
  // scores [key][row] of a block's chunks of keys: a chunk's 16 keys are 16 independent sums, each a
  // vector of the 16 rows, and each pair of query dimensions is loaded once for all of them
  template <int64_t D>
  static void score(const uint32_t* query_pairs, const uint16_t* keys, float* scores, int64_t chunks) {
    for (int64_t c = 0; c < chunks; ++c) {
      const uint16_t* chunk = keys + c * KEY_CHUNK * D;
      __m512 sums[KEY_CHUNK];
      for (int64_t t = 0; t < KEY_CHUNK; ++t) sums[t] = _mm512_setzero_ps();
      for (int64_t i = 0; i < D / 2; ++i) {
        const __m512bh query = (__m512bh)_mm512_load_si512(query_pairs + i * TILE_ROWS);
        for (int64_t t = 0; t < KEY_CHUNK; ++t) {
          uint32_t pair;
          std::memcpy(&pair, chunk + t * D + 2 * i, sizeof pair);
          sums[t] = _mm512_dpbf16_ps(sums[t], query, (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair)));
        }
      }
      for (int64_t t = 0; t < KEY_CHUNK; ++t) _mm512_store_ps(scores + (c * KEY_CHUNK + t) * TILE_ROWS, sums[t]);
    }
  }

  // acc [16 rows][D] += probs [16 rows][2 * pairs chunks of keys] times those keys' value pairs,
  // pair_rows(D) rows at a time: each value vector is loaded once for those rows
  template <int64_t D>
  static void weigh(float* acc, const uint16_t* probs, const uint32_t* values, int64_t pairs) {
    constexpr int V = D / 16, R = pair_rows(D);
    const int64_t key_pairs = pairs * KEY_CHUNK;  // a pair of chunks holds KEY_CHUNK pairs of keys
    for (int64_t row = 0; row < TILE_ROWS; row += R) {
      __m512 sums[R][V];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < V; ++c) sums[r][c] = _mm512_loadu_ps(acc + (row + r) * D + 16 * c);
      for (int64_t j = 0; j < key_pairs; ++j) {
        __m512bh value[V];
        for (int c = 0; c < V; ++c) value[c] = (__m512bh)_mm512_loadu_si512(values + j * D + 16 * c);
        for (int r = 0; r < R; ++r) {
          uint32_t weight;
          std::memcpy(&weight, probs + (row + r) * KEY_BLOCK + 2 * j, sizeof weight);
          const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(weight));
          for (int c = 0; c < V; ++c) sums[r][c] = _mm512_dpbf16_ps(sums[r][c], w, value[c]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < V; ++c) _mm512_storeu_ps(acc + (row + r) * D + 16 * c, sums[r][c]);
    }
  }
};

#if defined(__AMX_BF16__)
// Linux lends a process the AMX tile registers only once it asks (oneDNN asks too; asking twice is harmless)
bool tiles_granted() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return granted;
}

// Every tile used here is 16 rows of 64 bytes: 16 x 32 bf16 (A), 16 pairs x 16 columns (B), 16 x 16 float32 (C)
void configure_tiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// acc[16 rows][the 4 column tiles from `column`] += probs [16 rows][2 * pairs chunks of keys] times those
// keys' values (value_pairs' layout: a pair of chunks is one B tile per column tile); tile registers are
// named at compile time, hence the unrolled cases
template <int64_t D>
inline void weigh_values(float* acc, const uint16_t* probs, const uint32_t* values, int64_t pairs, int64_t column) {
  const int64_t n = std::min<int64_t>(4, D / 16 - column);
  float* out = acc + column * 16;
  _tile_loadd(0, out, D * 4);
  if (n > 1) _tile_loadd(1, out + 16, D * 4);
  if (n > 2) _tile_loadd(2, out + 32, D * 4);
  if (n > 3) _tile_loadd(3, out + 48, D * 4);
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const uint32_t* v = values + pair * KEY_CHUNK * D + column * 16;  // a pair of chunks: KEY_CHUNK rows of D
    _tile_loadd(4, probs + pair * 2 * KEY_CHUNK, KEY_BLOCK * 2);
    _tile_loadd(5, v, D * 4);
    _tile_dpbf16ps(0, 4, 5);
    if (n > 1) { _tile_loadd(6, v + 16, D * 4); _tile_dpbf16ps(1, 4, 6); }
    if (n > 2) { _tile_loadd(7, v + 32, D * 4); _tile_dpbf16ps(2, 4, 7); }
    if (n > 3) { _tile_loadd(5, v + 48, D * 4); _tile_dpbf16ps(3, 4, 5); }
  }
  _tile_stored(0, out, D * 4);
  if (n > 1) _tile_stored(1, out + 16, D * 4);
  if (n > 2) _tile_stored(2, out + 32, D * 4);
  if (n > 3) _tile_stored(3, out + 48, D * 4);
}

// scores [key][row] of up to 4 chunks of keys (K Q^T), a chunk per accumulating tile: four independent
// chains keep the tile unit busy, where one or two wait on each product before the next (tile registers
// are named at compile time, hence the unrolled cases)
template <int64_t D>
inline void score_chunks(const uint32_t* query_pairs, const uint16_t* keys, float* scores, int64_t n) {
  _tile_zero(0);
  if (n > 1) _tile_zero(1);
  if (n > 2) _tile_zero(2);
  if (n > 3) _tile_zero(3);
  for (int64_t part = 0; part < D / 32; ++part) {
    const uint16_t* k = keys + part * 32;
    _tile_loadd(5, query_pairs + part * 16 * TILE_ROWS, 64);
    _tile_loadd(4, k, D * 2);
    _tile_dpbf16ps(0, 4, 5);
    if (n > 1) { _tile_loadd(6, k + KEY_CHUNK * D, D * 2); _tile_dpbf16ps(1, 6, 5); }
    if (n > 2) { _tile_loadd(7, k + 2 * KEY_CHUNK * D, D * 2); _tile_dpbf16ps(2, 7, 5); }
    if (n > 3) { _tile_loadd(4, k + 3 * KEY_CHUNK * D, D * 2); _tile_dpbf16ps(3, 4, 5); }
  }
  _tile_stored(0, scores, 64);
  if (n > 1) _tile_stored(1, scores + KEY_CHUNK * TILE_ROWS, 64);
  if (n > 2) _tile_stored(2, scores + 2 * KEY_CHUNK * TILE_ROWS, 64);
  if (n > 3) _tile_stored(3, scores + 3 * KEY_CHUNK * TILE_ROWS, 64);
}

// The products of rows in lanes on the AMX tiles
struct TileProducts {
  template <int64_t D>
  static void score(const uint32_t* query_pairs, const uint16_t* keys, float* scores, int64_t chunks) {
    for (int64_t c = 0; c < chunks; c += 4)
      score_chunks<D>(query_pairs, keys + c * KEY_CHUNK * D, scores + c * KEY_CHUNK * TILE_ROWS,
                      std::min<int64_t>(4, chunks - c));
  }

  template <int64_t D>
  static void weigh(float* acc, const uint16_t* probs, const uint32_t* values, int64_t pairs) {
    for (int64_t column = 0; column < D / 16; column += 4) weigh_values<D>(acc, probs, values, pairs, column);
  }
};

#endif  // __AMX_BF16__

// attend_tile with a row per lane: 16 rows at a time score a block of keys, each key's scores one vector
// of the rows (K Q^T: the keys' rows straight from the packed cache), so that the softmax runs down the
// lanes with a row in each (no sums across lanes, one exponential per 16 scores); its probabilities,
// turned back into rows, weigh the block's values (P V) into float32 sums kept in memory between blocks.
// Products: PairDotProducts or TileProducts.
template <typename Products, int64_t D>
void attend_rows_in_lanes(const at::BFloat16* q, const PackedContext& context, at::BFloat16* out, const Layout& L,
                          int64_t kv_head, int64_t context_start, int64_t first_query, int64_t num_queries,
                          float scale, int64_t window, float softcap) {
  static_assert(D % 32 == 0, "the query is transposed 32 dimensions at a time");
  const int64_t per_kv = L.per_kv, rows = num_queries * per_kv;
  const int64_t first = context_start + first_query;
  const int64_t start = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
  alignas(64) uint32_t query_pairs[D / 2 * TILE_ROWS];  // Q^T: [pair of dimensions][row]
  alignas(64) float scores[KEY_BLOCK * TILE_ROWS];      // [key][row]
  alignas(64) uint16_t probs[TILE_ROWS * KEY_BLOCK];    // [row][key]
  alignas(64) float acc[TILE_ROWS * D];
  alignas(64) int32_t position[TILE_ROWS];
  for (int64_t group = 0; group < rows; group += TILE_ROWS) {
    const int64_t n = std::min(TILE_ROWS, rows - group);
    const at::BFloat16* query[TILE_ROWS];  // rows past n repeat the last one: their outputs are dropped
    for (int64_t r = 0; r < TILE_ROWS; ++r) {
      const int64_t row = group + std::min(r, n - 1), i = row / per_kv;
      position[r] = static_cast<int32_t>(first + i);
      query[r] = q + ((first_query + i) * L.num_heads + kv_head * per_kv + row % per_kv) * D;
    }
    for (int64_t part = 0; part < D / 32; ++part) {
      __m512i block[TILE_ROWS];
      for (int64_t r = 0; r < TILE_ROWS; ++r) block[r] = _mm512_loadu_si512(query[r] + part * 32);
      transpose16(block);
      for (int64_t j = 0; j < 16; ++j) _mm512_store_si512(query_pairs + (part * 16 + j) * TILE_ROWS, block[j]);
    }
    const __m512i positions = _mm512_load_si512(position);
    const Visibility visible{positions, _mm512_sub_epi32(positions, _mm512_set1_epi32(static_cast<int32_t>(window))),
                             position[0], position[TILE_ROWS - 1], window};
    __m512 max_score = _mm512_set1_ps(-FLT_MAX), total = _mm512_setzero_ps();
    std::fill(acc, acc + TILE_ROWS * D, 0.f);
    const int64_t first_index = start / KEY_CHUNK - context.first_chunk;
    const int64_t end_index = position[TILE_ROWS - 1] / KEY_CHUNK + 1 - context.first_chunk;
    for (int64_t block = first_index; block < end_index; block += KEY_BLOCK / KEY_CHUNK) {
      const int64_t chunks = std::min(KEY_BLOCK / KEY_CHUNK, end_index - block);
      const uint16_t* keys = context.key_rows.data() + block * KEY_CHUNK * D;
      Products::template score<D>(query_pairs, keys, scores, chunks);
      softmax_block<D>(scores, probs, acc, chunks, (context.first_chunk + block) * KEY_CHUNK, visible, scale, softcap,
                       block > first_index, max_score, total);
      const uint32_t* values = context.value_pairs.data() + block * KEY_CHUNK / 2 * D;
      Products::template weigh<D>(acc, probs, values, (chunks + 1) / 2);
    }
    alignas(64) float totals[TILE_ROWS];
    _mm512_store_ps(totals, total);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t i = (group + r) / per_kv;
      at::BFloat16* o = out + ((first_query + i) * L.num_heads + kv_head * per_kv + (group + r) % per_kv) * D;
      const float inverse = 1.f / totals[r];
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<at::BFloat16>(acc[r * D + d] * inverse);
    }
  }
}
#else
constexpr bool HAS_PAIR_DOTS = false;
#endif  // __AVX512BF16__

template <bool PAIRS, typename T, int FIXED_D>
void attend_tile(const T* q, const PackedContext& context, T* out, const Layout& L, int64_t head_dim,
                 int64_t kv_head, int64_t context_start, int64_t first_query, int64_t num_queries, float scale,
                 int64_t window, float softcap) {
  const int64_t D = FIXED_D > 0 ? FIXED_D : head_dim;
  const int64_t per_kv = L.per_kv;
  const int64_t rows = num_queries * per_kv;
  const int64_t padded_rows = (rows + ROW_GROUP - 1) / ROW_GROUP * ROW_GROUP;
  // row r: query first_query + r / per_kv, head kv_head * per_kv + r % per_kv; padded rows stay zero
  std::vector<float> query(PAIRS ? 0 : padded_rows * D, 0.f), acc(padded_rows * D, 0.f);
  std::vector<uint32_t> query_pairs(PAIRS ? padded_rows * D / 2 : 0, 0);  // unscaled: scale applies to scores
  std::vector<float> max_score(padded_rows, -INFINITY), total(padded_rows, 0.f);
  std::vector<int64_t> position(padded_rows);
  for (int64_t r = 0; r < padded_rows; ++r) {
    const int64_t i = std::min(r, rows - 1) / per_kv;
    position[r] = context_start + first_query + i;
    if (r >= rows) continue;
    const T* src = q + ((first_query + i) * L.num_heads + kv_head * per_kv + r % per_kv) * D;
    if constexpr (PAIRS)
      std::memcpy(query_pairs.data() + r * D / 2, src, D * sizeof(T));
    else
      for (int64_t d = 0; d < D; ++d) query[r * D + d] = to_float(src[d]) * scale;
  }
  const int64_t first = context_start + first_query, last = first + num_queries - 1;
  const int64_t start = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
  row_lanes key_offsets[PARTS];  // each lane's key within a chunk
  for (int part = 0; part < PARTS; ++part)
    for (int64_t t = 0; t < ROW_LANES; ++t) key_offsets[part][t] = static_cast<float>(part * ROW_LANES + t);

  for (int64_t chunk = start / KEY_CHUNK; chunk * KEY_CHUNK <= last; ++chunk) {
    const int64_t pos = chunk * KEY_CHUNK;
    const int64_t index = chunk - context.first_chunk;
    // whether some row sees only part of the chunk: the diagonal, or a window's edge
    const bool partial = pos + KEY_CHUNK - 1 > first || (window > 0 && pos <= last - window);
    row_lanes key_positions[PARTS];
    for (int part = 0; part < PARTS; ++part) key_positions[part] = key_offsets[part] + static_cast<float>(pos);
    for (int64_t group = 0; group < padded_rows; group += ROW_GROUP) {
      row_lanes scores[ROW_GROUP][PARTS];
#if defined(__AVX512BF16__)
      if constexpr (PAIRS) {
        static_assert(PARTS == 1, "AVX-512 scores a chunk in one register");
        vec16 pair_scores[ROW_GROUP];
        score_pairs<FIXED_D>(query_pairs.data() + group * D / 2, context.key_pairs.data() + index * D / 2, pair_scores);
        for (int g = 0; g < ROW_GROUP; ++g) scores[g][0] = pair_scores[g] * scale;
      } else
#endif
      {
        for (int g = 0; g < ROW_GROUP; ++g)
          for (int part = 0; part < PARTS; ++part) scores[g][part] = row_lanes{};
        const float* qg = query.data() + group * D;
        const float* keys = reinterpret_cast<const float*>(context.keys.data() + index * D);
        for (int64_t d = 0; d < D; ++d)
          for (int part = 0; part < PARTS; ++part) {
            const row_lanes k = load_row_lanes(keys + d * KEY_CHUNK + part * ROW_LANES);
            for (int g = 0; g < ROW_GROUP; ++g) scores[g][part] += qg[g * D + d] * k;
          }
      }
      // each row's probabilities for the chunk, its sums rescaled where its max grew; masked rows and
      // padding get zeros
      vec16 probs[ROW_GROUP];
      for (int g = 0; g < ROW_GROUP; ++g) {
        const int64_t r = group + g;
        probs[g] = vec16{};
        if (r >= rows) continue;
        row_lanes* s = scores[g];
        if (softcap > 0.f)
          for (int part = 0; part < PARTS; ++part)
            s[part] = softcap * tanh_lanes<row_lanes, row_int_lanes>(s[part] * (1.f / softcap));
        if (partial) {
          const float p = static_cast<float>(position[r]);
          for (int part = 0; part < PARTS; ++part) {
            row_int_lanes visible = key_positions[part] <= p;
            if (window > 0) visible &= key_positions[part] > p - static_cast<float>(window);
            s[part] = visible ? s[part] : -INFINITY;
          }
        }
        row_lanes most = s[0];
        for (int part = 1; part < PARTS; ++part) most = most > s[part] ? most : s[part];
        const float chunk_max = largest_lane(most);
        if (chunk_max == -INFINITY) continue;  // every key of the chunk is masked for this row
        if (chunk_max > max_score[r]) {
          const float shrink = std::exp(max_score[r] - chunk_max);
          total[r] *= shrink;
          float* a = acc.data() + r * D;
          for (int64_t d = 0; d < D; ++d) a[d] *= shrink;
          max_score[r] = chunk_max;
        }
        row_lanes sum = {};
        for (int part = 0; part < PARTS; ++part) {
          const row_lanes e = exp_lanes<row_lanes, row_int_lanes>(s[part] - max_score[r]);
          sum += e;
          std::memcpy(reinterpret_cast<float*>(&probs[g]) + part * ROW_LANES, &e, sizeof e);
        }
        total[r] += lane_sum(sum);
      }
#if defined(__AVX512BF16__)
      if constexpr (PAIRS) {
        constexpr int R = pair_rows(FIXED_D);
        const uint32_t* values = context.value_pairs.data() + index * KEY_CHUNK / 2 * D;
        for (int g = 0; g < ROW_GROUP && group + g < rows; g += R)
          add_weighted_value_pairs<FIXED_D>(acc.data() + (group + g) * D, probs + g, values);
        continue;
      }
#endif
      for (int g = 0; g < ROW_GROUP && group + g < rows; ++g)
        add_weighted_values<FIXED_D>(acc.data() + (group + g) * D, probs[g], context.values.data() + index * KEY_CHUNK * D, D);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* o = out + ((first_query + r / per_kv) * L.num_heads + kv_head * per_kv + r % per_kv) * D;
    const float inverse = 1.f / total[r];
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[r * D + d] * inverse);
  }
}

template <typename T, typename KV, int FIXED_D>
void prefill_attention(const T* q, const KV* kv, const int32_t* block_table, const int64_t* query_starts,
                       const int64_t* query_lens, const int64_t* seq_lens, T* out, int64_t num_seqs,
                       const Layout& L, int64_t head_dim, float scale, int64_t window, float softcap) {
  struct Task {
    int64_t seq, kv_head, first_query;
  };
  std::vector<Task> tasks;
  std::vector<int64_t> out_starts(num_seqs);
  for (int64_t seq = 0, rows = 0; seq < num_seqs; rows += query_lens[seq], ++seq) {
    out_starts[seq] = rows;
    for (int64_t first = 0; first < query_lens[seq]; first += QUERY_TILE)
      for (int64_t h = 0; h < L.num_kv_heads; ++h) tasks.push_back({seq, h, first});
  }
  // the costliest (latest) tiles first, so that the last tasks handed out are short ones
  auto tile_end = [&](const Task& t) { return seq_lens[t.seq] - query_lens[t.seq] + t.first_query; };
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) { return tile_end(a) > tile_end(b); });
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  constexpr bool PAIRS = HAS_PAIR_DOTS && std::is_same_v<T, at::BFloat16> &&
                         (std::is_same_v<KV, at::BFloat16> || std::is_same_v<KV, at::Float8_e5m2> ||
                          std::is_same_v<KV, int8_t>) &&
                         FIXED_D > 0 && FIXED_D % 16 == 0;
  std::vector<PackedContext> contexts(num_seqs * L.num_kv_heads);
  const int threads = at::get_num_threads();
  constexpr bool LANES = PAIRS && FIXED_D % 32 == 0;  // rows in lanes: the query is transposed 32 dimensions at a time
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
  const bool tiles = LANES && tiles_granted();
#endif
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * L.num_kv_heads; ++item) {
      const int64_t seq = item / L.num_kv_heads, context_start = seq_lens[seq] - query_lens[seq];
      const int64_t start = window > 0 ? std::max<int64_t>(0, context_start - window + 1) : 0;
      pack_context<PAIRS, T>(kv, block_table + seq * L.max_blocks, L, head_dim, item % L.num_kv_heads, start,
                             seq_lens[seq], LANES, contexts[item]);
    }
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (tiles) configure_tiles();
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; ++i) {
      const Task& task = tasks[i];
      const int64_t len = query_lens[task.seq];
#if defined(__AVX512BF16__)
      if constexpr (LANES) {
        const auto attend = [&](auto products) {
          attend_rows_in_lanes<decltype(products), FIXED_D>(
              q + query_starts[task.seq] * L.num_heads * head_dim, contexts[task.seq * L.num_kv_heads + task.kv_head],
              out + out_starts[task.seq] * L.num_heads * head_dim, L, task.kv_head, seq_lens[task.seq] - len,
              task.first_query, std::min(QUERY_TILE, len - task.first_query), scale, window, softcap);
        };
#if defined(__AMX_BF16__)
        if (tiles) {
          attend(TileProducts{});
          continue;
        }
#endif
        attend(PairDotProducts{});
      } else
#endif
      {
        attend_tile<PAIRS, T, FIXED_D>(q + query_starts[task.seq] * L.num_heads * head_dim,
                                       contexts[task.seq * L.num_kv_heads + task.kv_head],
                                       out + out_starts[task.seq] * L.num_heads * head_dim, L, head_dim, task.kv_head,
                                       seq_lens[task.seq] - len, task.first_query,
                                       std::min(QUERY_TILE, len - task.first_query), scale, window, softcap);
      }
    }
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (tiles) _tile_release();
#endif
  }
}

template <typename T, typename KV>
void prefill_attention_any(int64_t head_dim, const T* q, const KV* kv, const int32_t* block_table,
                           const int64_t* query_starts, const int64_t* query_lens, const int64_t* seq_lens, T* out,
                           int64_t num_seqs, const Layout& L, float scale, int64_t window, float softcap) {
  switch (head_dim) {
#define NANOSERVE_HEAD_DIM(D)                                                                                 \
  case D:                                                                                                     \
    return prefill_attention<T, KV, D>(q, kv, block_table, query_starts, query_lens, seq_lens, out, num_seqs, \
                                       L, head_dim, scale, window, softcap);
    NANOSERVE_FOR_EACH_HEAD_DIM(NANOSERVE_HEAD_DIM)
#undef NANOSERVE_HEAD_DIM
    default:
      prefill_attention<T, KV, 0>(q, kv, block_table, query_starts, query_lens, seq_lens, out, num_seqs, L, head_dim,
                                  scale, window, softcap);
  }
}

}  // namespace

// q: [T, H, D] (the step's tokens); kv_cache: [2, Hkv, num_blocks, block_size, row]; block_table: int32
// [S, max_blocks]; query_starts, query_lens, seq_lens: int64 [S] (each sequence's first row of q, its new
// tokens, and its context including them, already in the cache); window: the last positions attended to
// (0: all); softcap: cap of cap * tanh(score / cap) (0: none) -> [sum(query_lens), H * D], sequence after
// sequence.
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                                      torch::Tensor query_starts, torch::Tensor query_lens, torch::Tensor seq_lens,
                                      double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_table.is_contiguous());
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32);
  auto starts = query_starts.to(torch::kInt64).contiguous();
  auto q_lens = query_lens.to(torch::kInt64).contiguous();
  auto s_lens = seq_lens.to(torch::kInt64).contiguous();
  const int64_t num_seqs = starts.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && block_table.size(0) == num_seqs);
  const int64_t cached_row = kv_cache.size(4);
  const Layout layout{num_heads,
                      num_kv_heads,
                      num_heads / num_kv_heads,
                      num_blocks * block_size * cached_row,
                      num_kv_heads * num_blocks * block_size * cached_row,
                      block_size,
                      block_table.size(1),
                      cached_row};
  const int64_t rows = q_lens.sum().item<int64_t>();
  auto out = torch::empty({rows, num_heads * head_dim}, q.options());
  with_attention_types(q.scalar_type(), kv_cache.scalar_type(), [&](auto t, auto kv) {
    using T = decltype(t);
    using KV = decltype(kv);
    TORCH_CHECK(cached_row == cache_row<KV>(head_dim), "KV cache rows of ", cached_row, " elements for a head size of ",
                head_dim);
    prefill_attention_any(head_dim, q.data_ptr<T>(), kv_cache.data_ptr<KV>(), block_table.data_ptr<int32_t>(),
                          starts.data_ptr<int64_t>(), q_lens.data_ptr<int64_t>(), s_lens.data_ptr<int64_t>(),
                          out.data_ptr<T>(), num_seqs, layout, static_cast<float>(scale), window,
                          static_cast<float>(softcap));
  });
  return out;
}
