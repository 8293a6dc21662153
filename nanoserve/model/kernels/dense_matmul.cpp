// dense_matmul: x @ W.T for an unquantized float32 W.
//
// A decode step of a few rows reads every weight once, so it should run at the memory's read speed. On a
// 2-core Zen 3, torch's float32 matmul did not: over SmolLM2-135M's weights it reached 9 GB/s at 1 row and
// 4-5 GB/s at 2 to 16 rows, where a plain read of the same bytes ran at 19 GB/s. This kernel streams each
// output column's weight row once per step: every thread takes tiles of 4 columns and, for all the step's
// rows, 4 at a time, accumulates the dot products in 8-lane vectors, so the tile's rows (4 x K floats) stay
// in L1/L2 while the step's activations pass over them.
//
// Every product is summed in the same order whatever the step's size and whichever block computes it, so a
// row's result does not depend on the rows beside it: a request decodes the same tokens alone or in any
// batch, and so does a prompt prefilled alone or beside others.
#include "kernels.h"
#include "work_split.h"

#include <algorithm>
#include <cmath>

namespace {

typedef float vec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));

constexpr int64_t TILE_COLUMNS = 4;
constexpr int64_t BLOCK_ROWS = 4;

inline vec8 load(const float* p) {
  vec8 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// acc + w * x, one rounding: an FMA instruction where there is one. The kernels build with -ffast-math,
// under which `acc += w * x` may be contracted or reassociated differently in each block's instantiation.
inline vec8 multiply_add(vec8 w, vec8 x, vec8 acc) {
#if defined(__AVX2__) && defined(__FMA__)
  return (vec8)_mm256_fmadd_ps((__m256)w, (__m256)x, (__m256)acc);
#else
  return acc + w * x;
#endif
}

// the 8 lanes' sum, in one fixed order (a scalar loop may be reordered differently per instantiation)
inline float lane_sum(vec8 v) {
  const vec4 half = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (half[0] + half[2]) + (half[1] + half[3]);
}

// out[r, column + c] for R rows and C columns: C * R accumulators in registers (at most 8 of them, with
// the R activations beside them: 16 AVX2 registers)
template <int R, int C>
void dot_block(const float* x, const float* w, float* out, int64_t k, int64_t n, int64_t column) {
  vec8 acc[C][R] = {};
  const int64_t whole = k - k % 8;
  for (int64_t i = 0; i < whole; i += 8) {
    vec8 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = load(x + r * k + i);
    for (int c = 0; c < C; ++c) {
      const vec8 wv = load(w + (column + c) * k + i);
      for (int r = 0; r < R; ++r) acc[c][r] = multiply_add(wv, xv[r], acc[c][r]);
    }
  }
  for (int c = 0; c < C; ++c) {
    for (int r = 0; r < R; ++r) {
      float total = lane_sum(acc[c][r]);
      for (int64_t i = whole; i < k; ++i) total = std::fma(x[r * k + i], w[(column + c) * k + i], total);
      out[r * n + column + c] = total;
    }
  }
}

// columns [begin, end) of up to BLOCK_ROWS rows
template <int R>
void dot_columns(const float* x, const float* w, float* out, int64_t k, int64_t n, int64_t begin, int64_t end) {
  constexpr int C = R <= 2 ? 4 : 2;
  int64_t column = begin;
  for (; column + C <= end; column += C) dot_block<R, C>(x, w, out, k, n, column);
  for (; column < end; ++column) dot_block<R, 1>(x, w, out, k, n, column);
}

void dot_rows(const float* x, const float* w, float* out, int64_t rows, int64_t k, int64_t n, int64_t begin,
              int64_t end) {
  switch (rows) {
    case 1: return dot_columns<1>(x, w, out, k, n, begin, end);
    case 2: return dot_columns<2>(x, w, out, k, n, begin, end);
    case 3: return dot_columns<3>(x, w, out, k, n, begin, end);
    default: return dot_columns<4>(x, w, out, k, n, begin, end);
  }
}

}  // namespace

void raw::dense_matmul(const float* x, int64_t rows, int64_t k, const float* weight, int64_t n, float* out) {
  const int64_t tiles = (n + TILE_COLUMNS - 1) / TILE_COLUMNS;
  split_balanced(0, tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t first = tile * TILE_COLUMNS, last = std::min(n, first + TILE_COLUMNS);
      for (int64_t row = 0; row < rows; row += BLOCK_ROWS)
        dot_rows(x + row * k, weight, out + row * n, std::min(BLOCK_ROWS, rows - row), k, n, first, last);
    }
  });
}

// x [rows, K], weight [N, K], bias [N] or None, all float32 -> [rows, N]
torch::Tensor dense_matmul(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "dense_matmul: x [rows, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32,
              "dense_matmul: float32 x and weight");
  TORCH_CHECK(weight.is_contiguous(), "dense_matmul: a contiguous weight");
  const int64_t rows = x.size(0), n = weight.size(0);
  TORCH_CHECK(!bias || (bias->scalar_type() == torch::kFloat32 && bias->numel() == n),
              "dense_matmul: a float32 bias [N]");
  const auto xc = x.contiguous();
  auto out = torch::empty({rows, n}, x.options());
  raw::dense_matmul(xc.data_ptr<float>(), rows, x.size(1), weight.data_ptr<float>(), n, out.data_ptr<float>());
  if (bias) raw::add_bias(out.data_ptr<float>(), bias->contiguous().data_ptr<float>(), rows, n);
  return out;
}
