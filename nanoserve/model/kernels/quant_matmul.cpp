// quant_matmul: x @ W.T with W in groups of 32 inputs, 4- or 8-bit unsigned codes, a scale and an offset
// per group (w = code * scale + low).
//
// A decode step reads every weight once and does little arithmetic with it. Expanding codes to floats
// costs more instructions than the memory system needs to deliver them, so the activations are quantized
// too, to int8 per group of 32 (scale = max |x| / 127), and each group is a VNNI integer dot product:
// one instruction multiplies 64 codes by 64 activations. The offset term uses the sum of the quantized
// activations, not the exact one: codes are unsigned, so code * scale carries most of each weight's value
// as a bias that the offset cancels, and with the same activations on both sides their rounding cancels
// with it (with the exact sum the error is three times as large).
//
// Codes are laid out in tiles of 16 output columns, so that one vector holds 4 consecutive inputs of 16
// columns and each dot product lands in one lane per column (no horizontal sums):
//   4 bits: [N / 16, K / 32, 4, 16 columns, 4 inputs], quad q in the low nibbles and quad q + 4 in the high
//   8 bits: [N / 16, K / 32, 8, 16 columns, 4 inputs]
//   scales: float16 [N / 16, K / 32, 2, 16 columns] (scale, then low): GGUF's Q4_0/Q4_1/Q8_0 values exactly
#include "kernels.h"
#include "work_split.h"

#include <algorithm>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define NANOSERVE_QUANT_MATMUL 1
#endif

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t TILE = 16;
constexpr int64_t MAX_ROWS = 8;  // rows of x per pass over a tile, their sums in registers (16 spill)
constexpr int64_t CHUNK_ROWS = 64;  // rows per pass over a thread's tiles (64 x K int8 stays in L1/L2)

#ifdef NANOSERVE_QUANT_MATMUL

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

inline void store(float* out, __m512 values) { _mm512_storeu_ps(out, values); }

inline void store(at::BFloat16* out, __m512 values) {  // round to nearest even, as torch does
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// out columns of one tile for ROWS rows of quantized x. The rows' dot products advance together, quad by
// quad: one row's 8 dependent VNNI steps alone would wait on each other's latency. Each activation quad
// is a broadcast memory operand of the VNNI instruction itself (GCC does not fold the broadcast).
template <int BITS, int ROWS, typename T>
void tile_rows(const int8_t* xq, const float* x_scales, const float* x_sums, const uint8_t* codes,
               const at::Half* scales, T* out, int64_t k, int64_t n, int64_t tile) {
  const int64_t groups = k / GROUP, group_bytes = GROUP * TILE * BITS / 8;
  const uint8_t* c = codes + tile * groups * group_bytes;
  const at::Half* s = scales + tile * groups * 2 * TILE;
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, c += group_bytes, s += 2 * TILE) {
    __m512i quads[8];
    load_group<BITS>(c, quads);
    __m512i dot[ROWS];
    for (int r = 0; r < ROWS; ++r) dot[r] = _mm512_setzero_si512();
    for (int q = 0; q < 8; ++q) {
      for (int r = 0; r < ROWS; ++r) {
        const int32_t* xg = reinterpret_cast<const int32_t*>(xq + r * k + g * GROUP);  // 4 inputs per int32
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(dot[r]) : "v"(quads[q]), "m"(xg[q]));
      }
    }
    const __m512 w_scale = half_to_float(s), w_low = half_to_float(s + TILE);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 scale = _mm512_mul_ps(w_scale, _mm512_set1_ps(x_scales[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(w_low, _mm512_set1_ps(x_sums[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) store(out + r * n + tile * TILE, acc[r]);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // bf16 is the high half of a float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Each group of 32 activations to int8 (scale = max |x| / 127), with its scale and the sum of its
// quantized values (times the scale), in one pass: two vectors a group.
template <typename T>
void quantize_activations(const T* x, int8_t* xq, float* scales, float* sums, int64_t groups) {
  split_work(0, groups, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const __m512 low = load16(x + g * GROUP), high = load16(x + g * GROUP + 16);
      const float max_abs = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
      const float scale = std::max(max_abs / 127.f, 1e-30f);
      const __m512 inverse = _mm512_set1_ps(1.f / scale);
      // to the nearest integer, ties to even (the default rounding mode), as std::nearbyint
      const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));
      const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * GROUP), _mm512_cvtepi32_epi8(q_low));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * GROUP + 16), _mm512_cvtepi32_epi8(q_high));
      scales[g] = scale;
      sums[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high)) * scale;
    }
  });
}

// Each thread takes a share of the tiles and, for up to CHUNK_ROWS rows at a time, finishes a tile before
// the next: its codes stay in L1 for all those rows, and a weight larger than the caches (the lm_head) is
// read from memory once per chunk, not once per MAX_ROWS rows.
template <int BITS, typename T>
void quant_matmul_impl(const int8_t* xq, const float* x_scales, const float* x_sums, const uint8_t* codes,
                       const at::Half* scales, T* out, int64_t rows, int64_t k, int64_t n) {
  const int64_t groups = k / GROUP;
  split_work(0, n / TILE, 4, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = 0; chunk < rows; chunk += CHUNK_ROWS) {
      const int64_t chunk_end = std::min(rows, chunk + CHUNK_ROWS);
      for (int64_t tile = begin; tile < end; ++tile) {
        for (int64_t row = chunk; row < chunk_end; row += MAX_ROWS) {
          const int8_t* xr = xq + row * k;
          const float* sc = x_scales + row * groups;
          const float* su = x_sums + row * groups;
          T* o = out + row * n;
          switch (std::min(MAX_ROWS, chunk_end - row)) {
            case 1: tile_rows<BITS, 1, T>(xr, sc, su, codes, scales, o, k, n, tile); break;
            case 2: tile_rows<BITS, 2, T>(xr, sc, su, codes, scales, o, k, n, tile); break;
            case 3: tile_rows<BITS, 3, T>(xr, sc, su, codes, scales, o, k, n, tile); break;
            case 4: tile_rows<BITS, 4, T>(xr, sc, su, codes, scales, o, k, n, tile); break;
            case 5: tile_rows<BITS, 5, T>(xr, sc, su, codes, scales, o, k, n, tile); break;
            case 6: tile_rows<BITS, 6, T>(xr, sc, su, codes, scales, o, k, n, tile); break;
            case 7: tile_rows<BITS, 7, T>(xr, sc, su, codes, scales, o, k, n, tile); break;
            default: tile_rows<BITS, 8, T>(xr, sc, su, codes, scales, o, k, n, tile);
          }
        }
      }
    }
  });
}

// x [rows, k] quantized into scratch, then times the codes into out [rows, n]
template <typename T>
void quantize_and_multiply(const T* x, int64_t rows, int64_t k, const uint8_t* codes, const at::Half* scales,
                           int64_t bits, int64_t n, const QuantScratch& scratch, T* out) {
  quantize_activations(x, scratch.xq, scratch.scales, scratch.sums, rows * k / GROUP);
  (bits == 4 ? quant_matmul_impl<4, T> : quant_matmul_impl<8, T>)(scratch.xq, scratch.scales, scratch.sums, codes,
                                                                   scales, out, rows, k, n);
}

#endif  // NANOSERVE_QUANT_MATMUL

}  // namespace

bool quant_matmul_supported() {
#ifdef NANOSERVE_QUANT_MATMUL
  return true;
#else
  return false;
#endif
}

// x: [M, K]; codes and scales as laid out above, bits 4 or 8 -> [M, N] in x's dtype.
torch::Tensor quant_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t bits) {
#ifdef NANOSERVE_QUANT_MATMUL
  TORCH_CHECK(bits == 4 || bits == 8, "quant_matmul: 4 or 8 bits");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && codes.is_contiguous() && scales.is_contiguous());
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && scales.scalar_type() == torch::kHalf);
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0) * TILE;
  TORCH_CHECK(k % GROUP == 0 && codes.size(1) == k * TILE * bits / 8, "quant_matmul: codes do not match x");
  TORCH_CHECK(scales.numel() == n / TILE * (k / GROUP) * 2 * TILE, "quant_matmul: scales do not match codes");
  auto xq = torch::empty({rows, k}, x.options().dtype(torch::kInt8));
  auto x_scales = torch::empty({rows, k / GROUP}, x.options().dtype(torch::kFloat32));
  auto x_sums = torch::empty_like(x_scales);
  const QuantScratch scratch{xq.data_ptr<int8_t>(), x_scales.data_ptr<float>(), x_sums.data_ptr<float>()};
  auto out = torch::empty({rows, n}, x.options());
  auto xc = x.contiguous();
  if (xc.scalar_type() == torch::kBFloat16) {
    quantize_and_multiply(xc.data_ptr<at::BFloat16>(), rows, k, codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                          bits, n, scratch, out.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(xc.scalar_type() == torch::kFloat32, "quant_matmul: bfloat16 or float32 x");
    quantize_and_multiply(xc.data_ptr<float>(), rows, k, codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), bits,
                          n, scratch, out.data_ptr<float>());
  }
  return out;
#else
  TORCH_CHECK(false, "quant_matmul needs AVX-512 VNNI; check quant_matmul_supported() first");
#endif
}

void raw_bf16::quant_matmul(const bf16* x, int64_t rows, int64_t k, const uint8_t* codes, const at::Half* scales,
                            int64_t bits, int64_t n, const QuantScratch& scratch, bf16* out) {
#ifdef NANOSERVE_QUANT_MATMUL
  quantize_and_multiply(x, rows, k, codes, scales, bits, n, scratch, out);
#else
  TORCH_CHECK(false, "quant_matmul needs AVX-512 VNNI; check quant_matmul_supported() first");
#endif
}
