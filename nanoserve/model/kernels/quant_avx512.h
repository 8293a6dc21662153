// quant_matmul's inner loops on AVX-512 VNNI: a tile's 16 columns in one register, one vpdpbusd per quad of
// inputs (64 multiply-adds).
#pragma once

#include <immintrin.h>

#include <algorithm>

#include "kernels.h"

namespace quant_isa {

constexpr int MAX_ROWS = 8;  // rows of x per pass over a tile, their sums in registers (16 spill)

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

// The codes of one group of one tile as 8 vectors of u8 [16 columns, 4 inputs], quad by quad.
template <int BITS>
inline void load_group(const uint8_t* codes, __m512i quads[8]) {
  if constexpr (BITS == 4) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    for (int v = 0; v < 4; ++v) {
      const __m512i packed = _mm512_loadu_si512(codes + 64 * v);
      quads[v] = _mm512_and_si512(packed, nibble);
      quads[v + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
    }
  } else {
    for (int v = 0; v < 8; ++v) quads[v] = _mm512_loadu_si512(codes + 64 * v);
  }
}

// out columns of one tile for ROWS rows of quantized x. The rows' dot products advance together, quad by
// quad: one row's 8 dependent VNNI steps alone would wait on each other's latency. Each activation quad
// is a broadcast memory operand of the VNNI instruction itself (GCC does not fold the broadcast).
// `prefetch`: how far ahead to fetch the codes (0 but for a chunk's first block of rows: later blocks find
// them cached).
// Without LOWS (8 bits, symmetric codes) each group's offset is -128 * scale, computed here, not read.
template <int BITS, bool LOWS, int ROWS, typename T>
void tile_rows(const Activations& x, const float* x_scales, const float* x_sums, const uint8_t* codes,
               const at::Half* scales, T* out, int64_t k, int64_t n, int64_t tile, int64_t prefetch) {
  static_assert(LOWS || BITS == 8, "4-bit codes always have offsets");
  constexpr int64_t scale_stride = (LOWS ? 2 : 1) * TILE;
  const int64_t groups = k / GROUP, group_bytes = GROUP * TILE * BITS / 8;
  const uint8_t* c = codes + tile * groups * group_bytes;
  const at::Half* s = scales + tile * groups * scale_stride;
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, c += group_bytes, s += scale_stride) {
    if (prefetch) prefetch_group_ahead<BITS, LOWS>(c, s, prefetch);
    __m512i quads[8];
    load_group<BITS>(c, quads);
    __m512i dot[ROWS];
    for (int r = 0; r < ROWS; ++r) dot[r] = _mm512_setzero_si512();
    for (int q = 0; q < 8; ++q) {
      for (int r = 0; r < ROWS; ++r) {
        const int32_t* xg = reinterpret_cast<const int32_t*>(x.xq + r * k + g * GROUP);  // 4 inputs per int32
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(dot[r]) : "v"(quads[q]), "m"(xg[q]));
      }
    }
    const __m512 w_scale = half_to_float(s);
    __m512 w_low;
    if constexpr (LOWS)
      w_low = half_to_float(s + TILE);
    else
      w_low = _mm512_mul_ps(w_scale, _mm512_set1_ps(-128.f));
    for (int r = 0; r < ROWS; ++r) {
      const __m512 scale = _mm512_mul_ps(w_scale, _mm512_set1_ps(x_scales[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(w_low, _mm512_set1_ps(x_sums[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) store16f(out + r * n + tile * TILE, acc[r]);
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
