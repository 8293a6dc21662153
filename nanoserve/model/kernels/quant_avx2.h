// quant_matmul's inner loops on AVX2 (no VNNI; AMD Zen 1-3, Intel before Ice Lake). vpmaddubsw multiplies
// 32 unsigned codes by 32 signed activations and adds neighbours into 16-bit sums, vpmaddwd widens those
// to one int32 per column. A register holds 8 of a tile's 16 columns: one or two rows take both halves in
// one pass, more rows two passes of 8 (tile_rows). Each quad of 4 activations goes to all 8 lanes: for one
// or two rows it is broadcast once per matmul into a buffer (Activations), else once per tile and group.
//
// 4 bits: a pair of products is at most 2 * 15 * 127, so a whole group's eight quads add up in 16 bits
// (8 * 3810 < 32767) and are widened once. 8 bits: code * 127 does not fit, so each code is taken as
// code - 128 in [-128, 127], its sign moved onto the activation (vpsignb) and its magnitude multiplied
// unsigned (pairs at most 2 * 128 * 127); the 128 comes back through the offset: w = (code - 128) *
// scale + (low + 128 * scale). Without LOWS (8 bits, low = -128 * scale: symmetric codes, GGUF's Q8_0) that
// offset is zero and its multiply-add is left out.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace quant_isa {

constexpr int64_t HALF = 8;  // columns per register
constexpr int MAX_ROWS = 4;   // rows of x per pass: their sums and accumulators fill the 16 registers
constexpr int MAX_TILES = 1;  // tiles per pass: a second tile's sums would not fit

inline __m256 half_to_float(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i broadcast_quad(const int8_t* x, int q) {  // inputs 4q..4q+3 of a group, in every int32
  int32_t quad;
  std::memcpy(&quad, x + 4 * q, sizeof quad);
  return _mm256_set1_epi32(quad);
}

// x as the tile loops read it: the int8 rows and, for up to BROADCAST_ROWS rows, every quad of 4 inputs
// already in all 8 lanes, for vpmaddubsw to take from memory. A vpbroadcastd per quad, tile and group costs
// Zen 1 vector µops that the loop is short of: a batch-1 decode step took 0.974x the time with the buffer.
struct Activations {
  const int8_t* xq;      // [rows, k]
  const __m256i* quads;  // [rows, k / 4], or null
  int64_t k;
  Activations from_row(int64_t row) const { return {xq + row * k, quads ? quads + row * k / 4 : nullptr, k}; }
};
constexpr int64_t BROADCAST_ROWS = 2;

// x's rows for one thread's tile loops: the quads go to a buffer of this thread's, valid until its next call
inline Activations prepare_activations(const int8_t* xq, int64_t rows, int64_t k) {
  if (rows > BROADCAST_ROWS) return {xq, nullptr, k};
  thread_local std::vector<__m256i> quads;
  quads.resize(rows * k / 4);
  for (int64_t q = 0; q < rows * k / 4; ++q) quads[q] = broadcast_quad(xq, q);
  return {xq, quads.data(), k};
}

// Quad q of row r of group g in all 8 lanes: from the buffer (BROADCAST), else broadcast here
template <bool BROADCAST>
inline __m256i group_quad(const Activations& x, int r, int64_t g, int q) {
  if constexpr (BROADCAST)
    return _mm256_load_si256(x.quads + r * x.k / 4 + g * GROUP / 4 + q);
  else
    return broadcast_quad(x.xq + r * x.k + g * GROUP, q);
}

// GCC reassociates a chain of integer adds into all the products first, then their sum: 32 products live at
// once, most of them spilled to the stack and read back (60 stack moves a group in a 4-row pass, a third of
// the tile loop's time at 32 rows on a Zen 3). An empty asm that claims to change the running sum keeps
// each add where the source puts it, and the sums in registers.
inline void add_in_order(__m256i& sum) { __asm__("" : "+x"(sum)); }

// Each row's int32 dot products of group g with HALVES * 8 columns, codes at `c` (this pass's halves of
// each quad vector): one pass over both halves broadcasts each row's inputs once for 16 columns.
template <int BITS, int ROWS, int HALVES, bool BROADCAST>
inline void group_dots(const uint8_t* c, const Activations& x, int64_t g, __m256i dot[HALVES][ROWS]) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 4) {
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    __m256i sums[HALVES][ROWS];
    for (int h = 0; h < HALVES; ++h)
      for (int r = 0; r < ROWS; ++r) sums[h][r] = _mm256_setzero_si256();
    for (int v = 0; v < 4; ++v) {  // quad v in the low nibbles, quad v + 4 in the high ones
      for (int h = 0; h < HALVES; ++h) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * v + 32 * h));
        const __m256i low = _mm256_and_si256(packed, nibble);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
        for (int r = 0; r < ROWS; ++r) {
          sums[h][r] = _mm256_add_epi16(sums[h][r], _mm256_maddubs_epi16(low, group_quad<BROADCAST>(x, r, g, v)));
          sums[h][r] = _mm256_add_epi16(sums[h][r], _mm256_maddubs_epi16(high, group_quad<BROADCAST>(x, r, g, v + 4)));
          add_in_order(sums[h][r]);
        }
      }
    }
    for (int h = 0; h < HALVES; ++h)
      for (int r = 0; r < ROWS; ++r) dot[h][r] = _mm256_madd_epi16(sums[h][r], ones);
  } else {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int h = 0; h < HALVES; ++h)
      for (int r = 0; r < ROWS; ++r) dot[h][r] = _mm256_setzero_si256();
    for (int q = 0; q < 8; ++q) {
      for (int h = 0; h < HALVES; ++h) {
        const __m256i centred =
            _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * q + 32 * h)), flip);
        const __m256i magnitude = _mm256_abs_epi8(centred);
        for (int r = 0; r < ROWS; ++r) {
          const __m256i signed_x = _mm256_sign_epi8(group_quad<BROADCAST>(x, r, g, q), centred);
          dot[h][r] = _mm256_add_epi32(dot[h][r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
          add_in_order(dot[h][r]);
        }
      }
    }
  }
}

// out columns of one tile for ROWS rows of quantized x (the layout's 64-byte quad vectors hold columns 0-7
// in their first 32 bytes, 8-15 in the second). Up to two rows take all 16 columns in one pass; more rows'
// sums and accumulators would not fit the 16 registers, so they take 8 columns a pass. `prefetch`: how far
// ahead to fetch the codes, in the first pass (0 but for a chunk's first block of rows: later blocks find
// them cached).
template <int BITS, bool LOWS, int ROWS, bool BROADCAST, typename T>
void tile_rows_with(const Activations& x, const float* x_scales, const float* x_sums, const uint8_t* codes,
                    const at::Half* scales, T* out, int64_t k, int64_t n, int64_t tile, int64_t prefetch) {
  static_assert(LOWS || BITS == 8, "4-bit codes always have offsets");
  constexpr int HALVES = ROWS <= 2 ? 2 : 1;
  constexpr int64_t scale_stride = (LOWS ? 2 : 1) * TILE;
  const int64_t groups = k / GROUP, group_bytes = GROUP * TILE * BITS / 8;
  for (int64_t pass = 0; pass < TILE / HALF / HALVES; ++pass) {
    const uint8_t* c = codes + tile * groups * group_bytes + 32 * HALVES * pass;
    const at::Half* s = scales + tile * groups * scale_stride + HALF * HALVES * pass;
    __m256 acc[HALVES][ROWS];
    for (int h = 0; h < HALVES; ++h)
      for (int r = 0; r < ROWS; ++r) acc[h][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g, c += group_bytes, s += scale_stride) {
      if (prefetch && pass == 0) prefetch_group_ahead<BITS, LOWS>(c, s, prefetch);
      __m256i dot[HALVES][ROWS];
      group_dots<BITS, ROWS, HALVES, BROADCAST>(c, x, g, dot);
      for (int h = 0; h < HALVES; ++h) {
        const __m256 w_scale = half_to_float(s + HALF * h);
        for (int r = 0; r < ROWS; ++r) {
          const __m256 scale = _mm256_mul_ps(w_scale, _mm256_set1_ps(x_scales[r * groups + g]));
          acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][r]), scale, acc[h][r]);
        }
        if constexpr (LOWS) {
          __m256 w_low = half_to_float(s + TILE + HALF * h);
          if constexpr (BITS == 8) w_low = _mm256_fmadd_ps(w_scale, _mm256_set1_ps(128.f), w_low);
          for (int r = 0; r < ROWS; ++r)
            acc[h][r] = _mm256_fmadd_ps(w_low, _mm256_set1_ps(x_sums[r * groups + g]), acc[h][r]);
        }
      }
    }
    for (int h = 0; h < HALVES; ++h)
      for (int r = 0; r < ROWS; ++r) store8(out + r * n + tile * TILE + HALF * (HALVES * pass + h), acc[h][r]);
  }
}

// tile_rows_with the quads from x's buffer where it has one (a matmul of more rows has none, the last block
// of one or two rows included)
template <int BITS, bool LOWS, int ROWS, int TILES, typename T>
void tile_rows(const Activations& x, const float* x_scales, const float* x_sums, const uint8_t* codes,
               const at::Half* scales, T* out, int64_t k, int64_t n, int64_t tile, int64_t prefetch) {
  static_assert(TILES == 1);
  if constexpr (ROWS <= BROADCAST_ROWS) {
    if (x.quads)
      return tile_rows_with<BITS, LOWS, ROWS, true>(x, x_scales, x_sums, codes, scales, out, k, n, tile, prefetch);
  }
  tile_rows_with<BITS, LOWS, ROWS, false>(x, x_scales, x_sums, codes, scales, out, k, n, tile, prefetch);
}

// One group of 32 activations to int8 (scale = max |x| / 127), with its scale and the sum of its quantized
// values (times the scale): the same values as the AVX-512 path, four vectors a group.
template <typename T>
inline void quantize_group(const T* x, int8_t* xq, float* scale, float* sum) {
  const __m256 magnitude_bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4];
  __m256 max_abs = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(x + 8 * i);
    max_abs = _mm256_max_ps(max_abs, _mm256_and_ps(v[i], magnitude_bits));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(max_abs), _mm256_extractf128_ps(max_abs, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  *scale = std::max(_mm_cvtss_f32(m) / 127.f, 1e-30f);
  const __m256 inverse = _mm256_set1_ps(1.f / *scale);
  __m256i q[4];  // to the nearest integer, ties to even (the default rounding mode), as std::nearbyint
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
  // the packs work within 128-bit lanes, leaving the 4-byte quads in the order 0 4 1 5 2 6 3 7
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  *sum = _mm_cvtsi128_si32(t) * *scale;
}

}  // namespace quant_isa
