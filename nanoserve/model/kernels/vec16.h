// vec16: 16 float32 lanes in whatever registers the CPU has (one AVX-512 register, two AVX ones, ...),
// with the lane-wise math the attention kernels share; and loops over float buffers at the CPU's own width.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t ivec16 __attribute__((vector_size(64)));

typedef float vec8 __attribute__((vector_size(32)));
typedef int32_t ivec8 __attribute__((vector_size(32)));

// e^x lane by lane for float lanes V and int32 lanes I of one width, to float precision (Cephes' polynomial
// for e^r on |r| <= ln 2 / 2, times 2^n); 0 below e^-87, where -inf (a masked score) lands.
template <typename V, typename I>
inline V exp_lanes(V x) {
  const I keep = x > -87.f;
  x = x < 88.f ? x : 88.f;
  x = x > -87.f ? x : -87.f;
  const V n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f + (x < 0 ? -0.5f : 0.5f), I), V);
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = 1.9875691500e-4f + r * 0.f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const I scaled = (I)p + (__builtin_convertvector(n, I) << 23);
  return (V)(scaled & keep);
}

// tanh lane by lane, to float precision: below |x| = 0.625 an odd polynomial (Cephes' tanhf), above it
// 1 - 2 / (e^2|x| + 1) with x's sign (whose cancellation near 0 the polynomial avoids). A NaN stays NaN, as
// with std::tanh, found by its bits (-ffast-math lets the compiler drop a float x != x).
template <typename V, typename I>
inline V tanh_lanes(V x) {
  const V magnitude = x < 0 ? -x : x;
  const V z = x * x;
  V p = -5.70498872745e-3f * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const V near_zero = p * z * x + x;
  const V away = 1.f - 2.f / (exp_lanes<V, I>(2.f * magnitude) + 1.f);
  const I nan = ((I)x & 0x7fffffff) > 0x7f800000;
  return nan ? x : magnitude < 0.625f ? near_zero : (x < 0 ? -away : away);
}

template <typename V>
inline V max_lanes(V a, V b) {
  return a > b ? a : b;
}

// The largest lane, halving the vector four times: a loop over the lanes compiled to stores and scalar
// compares, about four times the instructions, and the sampler's 64-token block maxima wait on it.
inline float max16(vec16 x) {
  x = max_lanes(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  x = max_lanes(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  x = max_lanes(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  x = max_lanes(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return x[0];
}

// Loops take the widest vector the CPU has at a time: 16 lanes on AVX-512, else 8. Without AVX-512, GCC
// compiles a comparison or select of 64-byte vectors lane by lane in scalar code (an exp of 16 lanes took
// about 200 instructions), and keeps their arrays on the stack: decode attention over 512 cached tokens
// on a Zen 3 took half the time with 8 lanes, prefill attention of a 512-token prompt a seventh.
#if defined(__AVX512F__)
typedef vec16 row_lanes;
typedef ivec16 row_int_lanes;
#else
typedef vec8 row_lanes;
typedef ivec8 row_int_lanes;
#endif
constexpr int64_t ROW_LANES = sizeof(row_lanes) / sizeof(float);

inline row_lanes load_row_lanes(const float* x) {
  row_lanes v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

inline float largest_lane(row_lanes v) {
#if defined(__AVX512F__)
  return max16(v);
#else
  float largest = v[0];
  for (int64_t t = 1; t < ROW_LANES; ++t) largest = std::max(largest, v[t]);
  return largest;
#endif
}

inline float lane_sum(row_lanes v) {
  float total = 0.f;
  for (int64_t t = 0; t < ROW_LANES; ++t) total += v[t];
  return total;
}

// the largest of x[0, n), n a positive multiple of 16
inline float max_of(const float* x, int64_t n) {
  row_lanes most = load_row_lanes(x);
  for (int64_t i = ROW_LANES; i < n; i += ROW_LANES) {
    most = max_lanes(most, load_row_lanes(x + i));
  }
  return largest_lane(most);
}

// x[i] = e^(x[i] - shift) for i in [0, n), n a multiple of 16; returns their sum
inline float exp_shifted(float* x, int64_t n, float shift) {
  row_lanes sum = {};
  for (int64_t i = 0; i < n; i += ROW_LANES) {
    const row_lanes p = exp_lanes<row_lanes, row_int_lanes>(load_row_lanes(x + i) - shift);
    sum += p;
    std::memcpy(x + i, &p, sizeof p);
  }
  return lane_sum(sum);
}

// x[i] = cap * tanh(x[i] * inner) for i in [0, n), n a multiple of 16: soft-capped scores or logits. std::tanh
// a score at a time took a Gemma 2 decode step at batch 32 as long as all its matmuls.
inline void soft_cap(float* x, int64_t n, float inner, float cap) {
  for (int64_t i = 0; i < n; i += ROW_LANES) {
    const row_lanes capped = cap * tanh_lanes<row_lanes, row_int_lanes>(load_row_lanes(x + i) * inner);
    std::memcpy(x + i, &capped, sizeof capped);
  }
}
