// sample_rows: one token per row of float32 logits, each row by its own temperature, top-k, top-p and
// min-p, drawn by inverse CDF with the row's uniform, by the rules of nanoserve.model.sampler's PyTorch
// path (the same draws up to the order of tied logits and rounding).
//
// A row costs a few passes over the vocabulary, all in cache: its maximum, each token's mass
// exp((x - max) / T) and their total, then the index-ordered walk to the uniform's target (no truncation)
// or the tokens with at least a factor of the maximum's mass (truncation), which are ordered as far as
// the kept prefix reaches and cut by top-k, top-p and min-p. The cut is exact: a token left out has less
// mass than every collected one, so it could only be kept if the collected ones do not end the prefix;
// then the factor is widened, and the last one collects every token. Temperature 0 is the argmax.
#include "kernels.h"
#include "vec16.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr float COLLECT_FACTORS[] = {1e-4f, 1e-8f, 0.f};  // of the maximum's mass, widest last
constexpr int64_t BLOCK = 64;  // tokens a search skips at once when none of them can be what it seeks

struct RowRule {
  float temperature;
  int64_t top_k;  // >= vocab: off
  float top_p;    // 1: off
  float min_p;    // 0: off
  float uniform;
};

inline vec16 load16(const float* x) {
  vec16 v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}

inline vec16 max_lanes(vec16 a, vec16 b) { return a > b ? a : b; }

// Four running maxima of 16 lanes each: a single one would wait on its own previous result every step, and
// the compiler does not split a max reduction by itself (it ran at a float per cycle). They are named
// values, not an array: GCC keeps an array of 64-byte vectors in memory on AVX2, which made the 64-token
// blocks of a search cost 5x as much.
float row_max(const float* x, int64_t vocab) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (vocab >= 64) {
    vec16 m0 = load16(x), m1 = load16(x + 16), m2 = load16(x + 32), m3 = load16(x + 48);
    for (i = 64; i + 64 <= vocab; i += 64) {
      m0 = max_lanes(m0, load16(x + i));
      m1 = max_lanes(m1, load16(x + i + 16));
      m2 = max_lanes(m2, load16(x + i + 32));
      m3 = max_lanes(m3, load16(x + i + 48));
    }
    m = max16(max_lanes(max_lanes(m0, m1), max_lanes(m2, m3)));
  }
  for (; i < vocab; ++i) m = std::max(m, x[i]);
  return m;
}

// The first index of the maximum, as torch.argmax picks among ties.
int64_t argmax(const float* x, int64_t vocab) {
  const float m = row_max(x, vocab);
  int64_t where = 0;
  while (where + BLOCK <= vocab && row_max(x + where, BLOCK) < m) where += BLOCK;
  while (where < vocab - 1 && x[where] != m) ++where;
  return where;
}

// Each token's mass exp((x - max) / T) into e (the maximum's is 1); returns their sum. Sums are kept in
// double: in float, a walk over a flat row of 49152 tokens drifts by more than a token's mass.
double row_masses(const float* x, int64_t vocab, float m, float inv_t, float* e) {
  double total = 0.0;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < vocab; ++i) {
    e[i] = std::exp((x[i] - m) * inv_t);
    total += e[i];
  }
  return total;
}

// The first index whose index-ordered cumulative mass exceeds target; where rounding leaves none, the
// last token with any mass.
int64_t walk(const float* e, int64_t vocab, double target) {
  double cumulative = 0.0;
  int64_t last = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    cumulative += e[i];
    if (cumulative > target) return i;
    if (e[i] > 0.f) last = i;
  }
  return last;
}

using Candidate = std::pair<float, int64_t>;  // (mass, token)

// Heap order: the top is the largest mass, the lowest token among equal masses.
bool comes_after(const Candidate& a, const Candidate& b) {
  return a.first < b.first || (a.first == b.first && a.second > b.second);
}

// The truncated draw. The candidates are a heap, so only the tokens up to the kept prefix's end are
// ordered (a flat row collects thousands and keeps hundreds); ordered holds them, largest first.
int64_t draw_truncated(const float* e, int64_t vocab, double total, const RowRule& rule,
                       std::vector<Candidate>& candidates, std::vector<Candidate>& ordered) {
  const bool limited = rule.top_k < vocab;
  for (float factor : COLLECT_FACTORS) {
    const bool everything = factor == 0.f;
    candidates.clear();
    for (int64_t start = 0; start < vocab; start += BLOCK) {
      const int64_t end = std::min(start + BLOCK, vocab);
      if (row_max(e + start, end - start) < factor) continue;
      for (int64_t i = start; i < end; ++i) {
        if (e[i] >= factor) candidates.emplace_back(e[i], i);
      }
    }
    if (limited && static_cast<int64_t>(candidates.size()) < rule.top_k && !everything) continue;
    std::make_heap(candidates.begin(), candidates.end(), comes_after);
    auto heap_end = candidates.end();
    auto pop = [&] {
      std::pop_heap(candidates.begin(), heap_end, comes_after);
      ordered.push_back(*--heap_end);
    };
    ordered.clear();
    // top-p is measured against the top-k mass, or everything's when top-k is off
    double top_mass = total;
    if (limited) {
      top_mass = 0.0;
      while (static_cast<int64_t>(ordered.size()) < rule.top_k) {
        pop();
        top_mass += ordered.back().first;
      }
    }
    const double p_limit = rule.top_p * top_mass;
    // the kept prefix: top-k, then top-p, then min-p against the maximum's mass, 1
    double cumulative = 0.0;
    size_t kept = 0;
    bool ended = limited;
    while (true) {
      if (kept == ordered.size()) {
        if (limited || heap_end == candidates.begin()) break;
        pop();
      }
      const float mass = ordered[kept].first;
      if (kept > 0 && (cumulative >= p_limit || mass < rule.min_p)) {
        ended = true;
        break;
      }
      cumulative += mass;
      ++kept;
    }
    // an uncollected token has less mass than every collected one, and less than factor: it is cut if
    // the collected ones reached top-p's limit, or if min-p cuts below factor
    ended = ended || everything || cumulative >= p_limit || (rule.min_p > 0.f && rule.min_p >= factor);
    if (!ended) continue;
    const double target = rule.uniform * cumulative;
    double running = 0.0;
    for (size_t j = 0; j < kept; ++j) {
      running += ordered[j].first;
      if (running > target) return ordered[j].second;
    }
    return ordered[kept - 1].second;
  }
  return ordered.front().second;  // not reached: the last factor collects every token
}

int64_t sample_row(const float* x, int64_t vocab, const RowRule& rule) {
  if (rule.temperature == 0.f) return argmax(x, vocab);
  thread_local std::vector<float> masses;
  thread_local std::vector<Candidate> candidates, ordered;
  masses.resize(vocab);
  const double total = row_masses(x, vocab, row_max(x, vocab), 1.f / rule.temperature, masses.data());
  const bool truncates = rule.top_k < vocab || rule.top_p < 1.f || rule.min_p > 0.f;
  if (!truncates) return walk(masses.data(), vocab, rule.uniform * total);
  return draw_truncated(masses.data(), vocab, total, rule, candidates, ordered);
}

}  // namespace

// logits: float32 [R, V] contiguous; uniforms: float32 [R]; the rules one per row, as lists (four tensors
// built per step cost a batch-1 step more than its draw); top_k <= 0 or >= V: off. Returns int64 [R].
torch::Tensor sample_rows(torch::Tensor logits, const std::vector<float>& temperature,
                          const std::vector<int64_t>& top_k, const std::vector<float>& top_p,
                          const std::vector<float>& min_p, torch::Tensor uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() &&
                  logits.is_cpu() && uniforms.is_cpu(),
              "sample_rows: contiguous float32 logits [rows, vocab] and uniforms on the CPU");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const auto length = static_cast<size_t>(rows);
  TORCH_CHECK(temperature.size() == length && top_k.size() == length && top_p.size() == length &&
                  min_p.size() == length && uniforms.numel() == rows,
              "sample_rows: one temperature, top_k, top_p, min_p and uniform per row");
  auto u = uniforms.to(torch::kFloat32).contiguous();
  auto out = torch::empty({rows}, torch::kInt64);
  const float* x = logits.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t row_k = top_k[r] <= 0 ? vocab : std::min(top_k[r], vocab);
      o[r] = sample_row(x + r * vocab, vocab, RowRule{temperature[r], row_k, top_p[r], min_p[r], up[r]});
    }
  });
  return out;
}

// logits: float32 [R, V] contiguous -> int64 [R], each row's first index of its maximum (torch.argmax's
// pick), with the same vectorized max as the sampled rows: torch's argmax takes 3-10 times as long on a
// row of 49152 logits, and the greedy step at batch 1 waits on it.
torch::Tensor greedy_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
              "greedy_rows: contiguous float32 logits [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto out = torch::empty({rows}, torch::kInt64);
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax(x + r * vocab, vocab);
  });
  return out;
}
