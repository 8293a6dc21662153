// quant_matmul: x @ W.T with W in groups of 32 inputs, 4- or 8-bit unsigned codes, a scale and an offset
// per group (w = code * scale + low), or for 8 bits a scale alone (w = (code - 128) * scale: symmetric codes,
// GGUF's Q8_0, 34 bytes a group instead of 36).
//
// A decode step reads every weight once and does little arithmetic with it. Expanding codes to floats
// costs more instructions than the memory system needs to deliver them, so the activations are quantized
// too, to int8 per group of 32 (scale = max |x| / 127), and each group is a handful of integer dot
// products: on AVX-512 VNNI one instruction multiplies 64 codes by 64 activations (quant_avx512.h), on
// AVX2 two instructions multiply 32 (quant_avx2.h). The offset term uses the sum of the quantized
// activations, not the exact one: codes are unsigned, so code * scale carries most of each weight's value
// as a bias that the offset cancels, and with the same activations on both sides their rounding cancels
// with it (with the exact sum the error is three times as large).
//
// Codes are laid out in tiles of 16 output columns, so that one vector holds 4 consecutive inputs of 16
// columns and each dot product lands in one lane per column (no horizontal sums):
//   4 bits: [N / 16, K / 32, 4, 16 columns, 4 inputs], quad q in the low nibbles and quad q + 4 in the high
//   8 bits: [N / 16, K / 32, 8, 16 columns, 4 inputs]
//   scales: float16 [N / 16, K / 32, 2, 16 columns] (scale, then low): GGUF's Q4_0/Q4_1/Q8_0 values exactly,
//           or [N / 16, K / 32, 1, 16 columns] (scale; low = -128 * scale) for symmetric 8-bit codes
#include "kernels.h"
#include "work_split.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <optional>
#include <utility>
#include <vector>

#include <unistd.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "quant_avx512.h"
#define NANOSERVE_QUANT_MATMUL 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "quant_avx2.h"
#define NANOSERVE_QUANT_MATMUL 1
#endif

namespace {

std::atomic<int64_t> prefetch_bytes{4096};

#ifdef NANOSERVE_QUANT_MATMUL

using quant_isa::GROUP;
using quant_isa::MAX_ROWS;
using quant_isa::MAX_TILES;
using quant_isa::TILE;
constexpr int64_t CHUNK_ROWS = 64;  // rows per pass over a thread's tiles (64 x K int8 stays in L1/L2)

// Bytes of a core's L2 as the C library reads them from the CPU (glibc; 0 where it cannot tell)
#ifdef _SC_LEVEL2_CACHE_SIZE
const int64_t l2_bytes = std::max<int64_t>(0, sysconf(_SC_LEVEL2_CACHE_SIZE));
#else
constexpr int64_t l2_bytes = 0;
#endif

// x's rows quantized to int8 per group of 32, with each group's scale and the sum of its values
struct QuantizedRows {
  const int8_t* xq;
  const float* scales;
  const float* sums;
};

// Under this many groups, each thread of a matmul quantizes x itself (quantized_here) where one thread
// would quantize it for all: at batch 1 the others would wait for it, then meet it at a barrier.
constexpr int64_t SHARED_QUANTIZE_GROUPS = 1024;

template <typename T>
QuantizedRows quantize_shared(const T* x, int64_t groups, const QuantScratch& scratch) {
  split_work(0, groups, SHARED_QUANTIZE_GROUPS, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      quant_isa::quantize_group(x + g * GROUP, scratch.xq + g * GROUP, scratch.scales + g, scratch.sums + g);
  });
  return {scratch.xq, scratch.scales, scratch.sums};
}

// x quantized into this thread's buffers, valid until its next call
template <typename T>
QuantizedRows quantized_here(const T* x, int64_t groups) {
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> stats;  // scales, then sums
  xq.resize(groups * GROUP);
  stats.resize(2 * groups);
  for (int64_t g = 0; g < groups; ++g)
    quant_isa::quantize_group(x + g * GROUP, xq.data() + g * GROUP, stats.data() + g, stats.data() + groups + g);
  return {xq.data(), stats.data(), stats.data() + groups};
}

// tile_rows for TILES tiles and 1..MAX_ROWS / TILES rows, indexed by rows - 1
template <int BITS, bool LOWS, typename T, int TILES, int... R>
constexpr auto tile_kernels(std::integer_sequence<int, R...>) {
  return std::array{&quant_isa::tile_rows<BITS, LOWS, R + 1, TILES, T>...};
}

// Each thread takes a share of the tiles and, for up to CHUNK_ROWS rows at a time, finishes MAX_TILES
// tiles before the next: their codes stay in L1 for all those rows, and a weight larger than the caches
// (the lm_head) is read from memory once per chunk, not once per pass of rows. A chunk's first MAX_ROWS
// rows read the codes from memory, and take them one tile at a time: one stream, fetched ahead. The rest
// find them in L1 and take MAX_TILES tiles a pass (see tile_rows). Two tiles in the first pass too made
// decode at 8-16 rows 0.77-0.88x as fast; as they are, batch 16-64 decoded 1.09-1.11x as fast as with one
// tile a pass throughout (int4, AMD Zen 5). Where a thread's codes fit in 3/4 of its L2, the chunks after
// the first find them there and take MAX_TILES tiles from their first row (a 512-token prompt's four
// matmuls a layer 2.69-2.71 -> 2.64-2.67 ms). x comes quantized (`shared`), or each thread quantizes it
// for itself.
template <int BITS, bool LOWS, typename T>
void quant_matmul_impl(const T* x, const QuantizedRows* shared, const uint8_t* codes, const at::Half* scales, T* out,
                       int64_t rows, int64_t k, int64_t n) {
  const int64_t groups = k / GROUP;
  static constexpr auto narrow = tile_kernels<BITS, LOWS, T, 1>(std::make_integer_sequence<int, MAX_ROWS>{});
  static constexpr auto wide =
      tile_kernels<BITS, LOWS, T, MAX_TILES>(std::make_integer_sequence<int, MAX_ROWS / MAX_TILES>{});
  const int64_t prefetch = prefetch_bytes.load(std::memory_order_relaxed);
  // a tile's codes and scales (with their lows where there are any)
  const int64_t bytes_per_tile = k * TILE * BITS / 8 + groups * TILE * (LOWS ? 2 : 1) * int64_t(sizeof(at::Half));
  split_balanced(0, n / TILE, 4, [&](int64_t begin, int64_t end) {
    const QuantizedRows q = shared ? *shared : quantized_here(x, rows * groups);
    const quant_isa::Activations activations = quant_isa::prepare_activations(q.xq, rows, k);
    // rows [from, to) of the tiles from `tile` on, as many rows a pass as `kernels` take
    const auto passes = [&](const auto& kernels, int64_t tile, int64_t from, int64_t to, int64_t fetch) {
      const int64_t pass_rows = static_cast<int64_t>(kernels.size());
      for (int64_t row = from; row < to; row += pass_rows)
        kernels[std::min(pass_rows, to - row) - 1](activations.from_row(row), q.scales + row * groups,
                                                   q.sums + row * groups, codes, scales, out + row * n, k, n, tile,
                                                   row == from ? fetch : 0);
    };
    const bool codes_stay_in_l2 = 4 * (end - begin) * bytes_per_tile <= 3 * l2_bytes;
    for (int64_t chunk = 0; chunk < rows; chunk += CHUNK_ROWS) {
      const int64_t chunk_end = std::min(rows, chunk + CHUNK_ROWS);
      const int64_t first_end = chunk > 0 && codes_stay_in_l2 ? chunk : std::min(chunk_end, chunk + MAX_ROWS);
      for (int64_t tile = begin; tile < end; tile += MAX_TILES) {
        const int64_t tiles = std::min<int64_t>(MAX_TILES, end - tile);
        for (int64_t t = tile; t < tile + tiles; ++t) passes(narrow, t, chunk, first_end, prefetch);
        if (tiles == MAX_TILES)
          passes(wide, tile, first_end, chunk_end, 0);
        else
          for (int64_t t = tile; t < tile + tiles; ++t) passes(narrow, t, first_end, chunk_end, 0);
      }
    }
  });
}

// x [rows, k] quantized (into scratch, or by each thread for itself), then times the codes into out [rows, n]
template <typename T>
void quantize_and_multiply(const T* x, int64_t rows, int64_t k, const uint8_t* codes, const at::Half* scales,
                           int64_t bits, bool lows, int64_t n, const QuantScratch& scratch, T* out) {
  const int64_t groups = rows * k / GROUP;
  std::optional<QuantizedRows> shared;
  if (groups >= SHARED_QUANTIZE_GROUPS) shared = quantize_shared(x, groups, scratch);
  const auto impl = bits == 4 ? quant_matmul_impl<4, true, T>
                    : lows    ? quant_matmul_impl<8, true, T>
                              : quant_matmul_impl<8, false, T>;
  impl(x, shared ? &*shared : nullptr, codes, scales, out, rows, k, n);
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

int64_t weight_prefetch_bytes() { return prefetch_bytes.load(std::memory_order_relaxed); }

void set_weight_prefetch_bytes(int64_t bytes) {
  // in whole groups of 8-bit codes (512 bytes; two of 4-bit), so that the scales are fetched as far ahead
  TORCH_CHECK_VALUE(bytes >= 0 && bytes % 512 == 0 && bytes <= (1 << 16),
                    "quant_matmul: a prefetch distance in multiples of 512 bytes, up to 64 KiB, got ", bytes);
  prefetch_bytes.store(bytes, std::memory_order_relaxed);
}

bool quant_scales_have_lows(int64_t scale_count, int64_t k, int64_t n, int64_t bits) {
  const int64_t one_per_group_and_column = n / quant_isa::TILE * (k / quant_isa::GROUP) * quant_isa::TILE;
  TORCH_CHECK(scale_count == 2 * one_per_group_and_column ||
                  (bits == 8 && scale_count == one_per_group_and_column),
              "quant_matmul: scales do not match codes (a scale and a low per group and column, or for 8 bits a "
              "scale alone)");
  return scale_count == 2 * one_per_group_and_column;
}

// x: [M, K]; codes and scales as laid out above, bits 4 or 8 -> [M, N] in x's dtype.
torch::Tensor quant_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t bits) {
#ifdef NANOSERVE_QUANT_MATMUL
  TORCH_CHECK(bits == 4 || bits == 8, "quant_matmul: 4 or 8 bits");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && codes.is_contiguous() && scales.is_contiguous());
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && scales.scalar_type() == torch::kHalf);
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0) * TILE;
  TORCH_CHECK(k % GROUP == 0 && codes.size(1) == k * TILE * bits / 8, "quant_matmul: codes do not match x");
  const bool lows = quant_scales_have_lows(scales.numel(), k, n, bits);
  auto xq = torch::empty({rows, k}, x.options().dtype(torch::kInt8));
  auto x_scales = torch::empty({rows, k / GROUP}, x.options().dtype(torch::kFloat32));
  auto x_sums = torch::empty_like(x_scales);
  const QuantScratch scratch{xq.data_ptr<int8_t>(), x_scales.data_ptr<float>(), x_sums.data_ptr<float>()};
  auto out = torch::empty({rows, n}, x.options());
  auto xc = x.contiguous();
  if (xc.scalar_type() == torch::kBFloat16) {
    quantize_and_multiply(xc.data_ptr<at::BFloat16>(), rows, k, codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                          bits, lows, n, scratch, out.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(xc.scalar_type() == torch::kFloat32, "quant_matmul: bfloat16 or float32 x");
    quantize_and_multiply(xc.data_ptr<float>(), rows, k, codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), bits,
                          lows, n, scratch, out.data_ptr<float>());
  }
  return out;
#else
  TORCH_CHECK(false, "quant_matmul needs AVX-512 VNNI or AVX2; check quant_matmul_supported() first");
#endif
}

template <typename T>
void raw::quant_matmul(const T* x, int64_t rows, int64_t k, const uint8_t* codes, const at::Half* scales, int64_t bits,
                       bool lows, int64_t n, const QuantScratch& scratch, T* out) {
#ifdef NANOSERVE_QUANT_MATMUL
  quantize_and_multiply(x, rows, k, codes, scales, bits, lows, n, scratch, out);
#else
  TORCH_CHECK(false, "quant_matmul needs AVX-512 VNNI or AVX2; check quant_matmul_supported() first");
#endif
}
template void raw::quant_matmul(const at::BFloat16*, int64_t, int64_t, const uint8_t*, const at::Half*, int64_t, bool,
                                int64_t, const QuantScratch&, at::BFloat16*);
template void raw::quant_matmul(const float*, int64_t, int64_t, const uint8_t*, const at::Half*, int64_t, bool,
                                int64_t, const QuantScratch&, float*);
