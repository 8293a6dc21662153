// vec16: 16 float32 lanes in whatever registers the CPU has (one AVX-512 register, two AVX ones, ...),
// with the lane-wise math the attention kernels share.
#pragma once

#include <cstdint>

typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t ivec16 __attribute__((vector_size(64)));

// e^x lane by lane, to float precision (Cephes' polynomial for e^r on |r| <= ln 2 / 2, times 2^n); 0 below
// e^-87, where -inf (a masked score) lands.
inline vec16 exp16(vec16 x) {
  const ivec16 keep = x > -87.f;
  x = x < 88.f ? x : 88.f;
  x = x > -87.f ? x : -87.f;
  const vec16 n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f + (x < 0 ? -0.5f : 0.5f), ivec16), vec16);
  const vec16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vec16 p = 1.9875691500e-4f + r * 0.f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const ivec16 scaled = (ivec16)p + (__builtin_convertvector(n, ivec16) << 23);
  return (vec16)(scaled & keep);
}

inline float sum16(vec16 x) {
  float total = 0.f;
  for (int t = 0; t < 16; ++t) total += x[t];
  return total;
}
inline vec16 max_lanes(vec16 a, vec16 b) { return a > b ? a : b; }

// The largest lane, halving the vector four times: a loop over the lanes compiled to stores and scalar
// compares, about four times the instructions, and the sampler's 64-token block maxima wait on it.
inline float max16(vec16 x) {
  x = max_lanes(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  x = max_lanes(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  x = max_lanes(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  x = max_lanes(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return x[0];
}
