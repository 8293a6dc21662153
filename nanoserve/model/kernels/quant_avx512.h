// quant_matmul's inner loops on AVX-512 VNNI: a tile's 16 columns in one register, one vpdpbusd per quad of
// inputs (64 multiply-adds).
#pragma once

#include <immintrin.h>

#include <algorithm>

#include "kernels.h"

namespace quant_isa {

constexpr int MAX_ROWS = 8;   // rows of x per pass over one tile (MAX_ROWS / MAX_TILES over MAX_TILES)
constexpr int MAX_TILES = 2;  // tiles per pass where the codes are in L1 (quant_matmul_impl)

// x as the tile loops read it: the int8 rows (the AVX2 loops also take a broadcast copy of one or two rows)
struct Activations {
  const int8_t* xq;  // [rows, k]
  int64_t k;
  Activations from_row(int64_t row) const { return {xq + row * k, k}; }
};
inline Activations prepare_activations(const int8_t* xq, int64_t, int64_t k) { return {xq, k}; }

inline __m512 half_to_float(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Quads v and v + 4 of one group of one tile, u8 [16 columns, 4 inputs] each
template <int BITS>
inline void load_quad_pair(const uint8_t* group_codes, int v, __m512i& low, __m512i& high) {
  if constexpr (BITS == 4) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    const __m512i packed = _mm512_loadu_si512(group_codes + 64 * v);
    low = _mm512_and_si512(packed, nibble);
    high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
  } else {
    low = _mm512_loadu_si512(group_codes + 64 * v);
    high = _mm512_loadu_si512(group_codes + 64 * (v + 4));
  }
}

// The codes of one group of one tile as 8 vectors of u8 [16 columns, 4 inputs], quad by quad.
template <int BITS>
inline void load_group(const uint8_t* codes, __m512i quads[8]) {
  for (int v = 0; v < 4; ++v) load_quad_pair<BITS>(codes, v, quads[v], quads[v + 4]);
}

// out columns of TILES neighbouring tiles for ROWS rows of quantized x. With two tiles each activation
// quad is broadcast once for 32 columns; with one, every vpdpbusd loads its own quad (a broadcast memory
// operand: GCC does not fold the broadcast), and with the loads of the codes and the group's scales that
// is a load per multiply. On one thread of an AMD Zen 5, a 512-row prefill's four matmuls ran 1.11-1.19x
// as fast with 4 rows of 2 tiles a pass as with 8 rows of one. The rows' dot products advance together:
// one row's 8 dependent VNNI steps alone would wait on each other's latency. `prefetch`: how far ahead to
// fetch the codes (0 but for a chunk's first block of rows: later blocks find them cached).
// Without LOWS (8 bits, symmetric codes) each group's offset is -128 * scale, computed here, not read.
template <int BITS, bool LOWS, int ROWS, int TILES, typename T>
void tile_rows(const Activations& x, const float* x_scales, const float* x_sums, const uint8_t* codes,
               const at::Half* scales, T* out, int64_t k, int64_t n, int64_t tile, int64_t prefetch) {
  static_assert(LOWS || BITS == 8, "4-bit codes always have offsets");
  constexpr int64_t scale_stride = (LOWS ? 2 : 1) * TILE;
  const int64_t groups = k / GROUP, group_bytes = GROUP * TILE * BITS / 8;
  const int64_t tile_bytes = groups * group_bytes, tile_scales = groups * scale_stride;
  const uint8_t* c = codes + tile * tile_bytes;
  const at::Half* s = scales + tile * tile_scales;
  __m512 acc[ROWS][TILES];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TILES; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, c += group_bytes, s += scale_stride) {
    if (prefetch)
      for (int t = 0; t < TILES; ++t) prefetch_group_ahead<BITS, LOWS>(c + t * tile_bytes, s + t * tile_scales, prefetch);
    __m512i dot[ROWS][TILES];
    for (int r = 0; r < ROWS; ++r)
      for (int t = 0; t < TILES; ++t) dot[r][t] = _mm512_setzero_si512();
    if constexpr (TILES == 1) {  // a group's codes loaded at once (two quads at a time: batch 1 0.76-0.99x)
      __m512i quads[8];
      load_group<BITS>(c, quads);
      for (int q = 0; q < 8; ++q) {
        for (int r = 0; r < ROWS; ++r) {
          const int32_t* xg = reinterpret_cast<const int32_t*>(x.xq + r * k + g * GROUP);  // 4 inputs per int32
          __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(dot[r][0]) : "v"(quads[q]), "m"(xg[q]));
        }
      }
    } else {  // two quads of each tile at a time: the registers hold no more
      for (int v = 0; v < 4; ++v) {
        __m512i low[TILES], high[TILES];
        for (int t = 0; t < TILES; ++t) load_quad_pair<BITS>(c + t * tile_bytes, v, low[t], high[t]);
        for (int r = 0; r < ROWS; ++r) {
          const int32_t* xg = reinterpret_cast<const int32_t*>(x.xq + r * k + g * GROUP);
          const __m512i quad_v = _mm512_set1_epi32(xg[v]), quad_v4 = _mm512_set1_epi32(xg[v + 4]);
          for (int t = 0; t < TILES; ++t) dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], low[t], quad_v);
          for (int t = 0; t < TILES; ++t) dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], high[t], quad_v4);
        }
      }
    }
    for (int t = 0; t < TILES; ++t) {
      const __m512 w_scale = half_to_float(s + t * tile_scales);
      __m512 w_low;
      if constexpr (LOWS)
        w_low = half_to_float(s + t * tile_scales + TILE);
      else
        w_low = _mm512_mul_ps(w_scale, _mm512_set1_ps(-128.f));
      for (int r = 0; r < ROWS; ++r) {
        const __m512 scale = _mm512_mul_ps(w_scale, _mm512_set1_ps(x_scales[r * groups + g]));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][t]), scale, acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(w_low, _mm512_set1_ps(x_sums[r * groups + g]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TILES; ++t) store16f(out + r * n + (tile + t) * TILE, acc[r][t]);
}

// One group of 32 activations to int8 (scale = max |x| / 127), with its scale and the sum of its quantized
// values (times the scale): two vectors a group.
template <typename T>
inline void quantize_group(const T* x, int8_t* xq, float* scale, float* sum) {
  const __m512 low = load16f(x), high = load16f(x + 16);
  const float max_abs = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
  *scale = std::max(max_abs / 127.f, 1e-30f);
  const __m512 inverse = _mm512_set1_ps(1.f / *scale);
  // to the nearest integer, ties to even (the default rounding mode), as std::nearbyint
  const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));
  const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(xq), _mm512_cvtepi32_epi8(q_low));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 16), _mm512_cvtepi32_epi8(q_high));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high)) * *scale;
}

}  // namespace quant_isa
