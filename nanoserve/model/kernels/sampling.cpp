// sample_rows: one token per row of float32 logits, each row by its own temperature, top-k, top-p and
// min-p, drawn by inverse CDF with the row's uniform, by the rules of nanoserve.model.sampler's PyTorch
// path (the same draws up to the order of tied logits and rounding).
//
// A row costs a few passes over the vocabulary, all in cache: its maximum, each token's mass
// exp((x - max) / T) and their total, then the index-ordered walk to the uniform's target (no truncation).
// Under top-k, the k tokens of largest mass, ordered and cut by top-p and min-p. Otherwise the tokens with
// at least a factor of the maximum's mass, cut by top-p and min-p and drawn from by weighted selections,
// unordered. That cut is exact: a token left out has less mass than every collected one, so it could only be
// kept if the collected ones do not end the prefix; then the factor is widened, and the last one collects
// every token. Temperature 0 is the argmax.
#include "kernels.h"
#include "vec16.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
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

// Four running maxima of the CPU's vector width each: a single one would wait on its own previous result
// every step, and the compiler does not split a max reduction by itself (it ran at a float per cycle). They
// are named values, not an array: GCC keeps an array of vectors in memory. They are row_lanes, not vec16:
// without AVX-512, GCC keeps 64-byte vectors on the stack and takes their maxima lane by lane, which made a
// greedy batch-32 draw take 0.41 ms on a Zen 3.
float row_max(const float* x, int64_t vocab) {
  constexpr int64_t STEP = 4 * ROW_LANES;
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (vocab >= STEP) {
    row_lanes m0 = load_row_lanes(x), m1 = load_row_lanes(x + ROW_LANES);
    row_lanes m2 = load_row_lanes(x + 2 * ROW_LANES), m3 = load_row_lanes(x + 3 * ROW_LANES);
    for (i = STEP; i + STEP <= vocab; i += STEP) {
      m0 = max_lanes(m0, load_row_lanes(x + i));
      m1 = max_lanes(m1, load_row_lanes(x + i + ROW_LANES));
      m2 = max_lanes(m2, load_row_lanes(x + i + 2 * ROW_LANES));
      m3 = max_lanes(m3, load_row_lanes(x + i + 3 * ROW_LANES));
    }
    m = largest_lane(max_lanes(max_lanes(m0, m1), max_lanes(m2, m3)));
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

// A row's token masses exp((x - max) / T) (the maximum's is 1), their total, and the largest of each
// 64-token block, by which the truncated draws skip the blocks that hold nothing they collect.
struct RowMasses {
  std::vector<float> e;
  std::vector<float> block_max;
  double total = 0.0;
};

// One block's 64 masses into e and their largest into most; returns their sum, in float. The exp is vec16.h's
// polynomial, inlined: a call to the C library's vector expf per 8 masses made the masses 60 % of a sampled
// batch-32 draw on a Zen 3, and a second pass for the block maxima (a row_max per block) another fifth.
float block_masses(const float* x, float m, float inv_t, float* e, float& most) {
  row_lanes sum = {}, largest = {};
  for (int64_t j = 0; j < BLOCK; j += ROW_LANES) {
    const row_lanes mass = exp_lanes<row_lanes, row_int_lanes>((load_row_lanes(x + j) - m) * inv_t);
    std::memcpy(e + j, &mass, sizeof mass);
    sum += mass;
    largest = max_lanes(largest, mass);
  }
  most = largest_lane(largest);
  return lane_sum(sum);
}

// The total is kept in double: in float, a walk over a flat row of 49152 tokens drifts by more than a
// token's mass. A non-finite maximum (an inf or NaN logit) leaves every mass 0.
void fill_masses(const float* x, int64_t vocab, float inv_t, RowMasses& masses) {
  const float m = row_max(x, vocab);
  masses.e.resize(vocab);
  masses.block_max.resize((vocab + BLOCK - 1) / BLOCK);
  float* e = masses.e.data();
  double total = 0.0;
  const int64_t whole = vocab / BLOCK * BLOCK;
  for (int64_t i = 0; i < whole; i += BLOCK) total += block_masses(x + i, m, inv_t, e + i, masses.block_max[i / BLOCK]);
  if (whole < vocab) {  // the last block, padded with -inf (no mass), by the same arithmetic as the others
    float padded[BLOCK], padded_e[BLOCK];
    std::fill(padded, padded + BLOCK, -std::numeric_limits<float>::infinity());
    std::copy(x + whole, x + vocab, padded);
    total += block_masses(padded, m, inv_t, padded_e, masses.block_max[whole / BLOCK]);
    std::copy(padded_e, padded_e + (vocab - whole), e + whole);
  }
  masses.total = total;
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

// The candidates' order: the largest mass first, the lowest token among equal masses. A lambda, so that the
// sorts and partitions inline it (a function's address they call).
constexpr auto comes_before = [](const Candidate& a, const Candidate& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
};

// The token at the uniform's target among the first `kept` of ordered (largest mass first), target being
// the uniform times their mass; where rounding reaches no token, the last kept one.
int64_t pick(const std::vector<Candidate>& ordered, size_t kept, double target) {
  double running = 0.0;
  for (size_t j = 0; j < kept; ++j) {
    running += ordered[j].first;
    if (running > target) return ordered[j].second;
  }
  return ordered[kept - 1].second;
}

// The k tokens of largest mass, largest first (the lowest token among equal masses), into ordered. The
// k-th largest of the 64-token blocks' maxima is a floor: k blocks reach it, so the k-th largest mass does
// too, and only tokens at or above it are collected and ordered, typically from about k blocks. (Collecting
// by a factor of the maximum, as top-p does, would order the whole vocabulary of a row whose mass sits
// on fewer than k tokens.)
void top_k_tokens(const RowMasses& masses, int64_t k, std::vector<Candidate>& candidates,
                  std::vector<Candidate>& ordered) {
  thread_local std::vector<float> kth;
  const float* e = masses.e.data();
  const auto vocab = static_cast<int64_t>(masses.e.size());
  const std::vector<float>& block_max = masses.block_max;
  const int64_t blocks = static_cast<int64_t>(block_max.size());
  float floor = 0.f;  // no mass is less: where k exceeds the blocks, every token is collected
  if (k <= blocks) {
    kth.assign(block_max.begin(), block_max.end());
    std::nth_element(kth.begin(), kth.begin() + (k - 1), kth.end(), std::greater<float>());
    floor = kth[k - 1];
  }
  candidates.clear();
  for (int64_t b = 0; b < blocks; ++b) {
    if (block_max[b] < floor) continue;
    for (int64_t i = b * BLOCK; i < std::min(vocab, (b + 1) * BLOCK); ++i) {
      if (e[i] >= floor) candidates.emplace_back(e[i], i);
    }
  }
  k = std::min<int64_t>(k, static_cast<int64_t>(candidates.size()));  // a guard: k blocks reach the floor
  std::partial_sort(candidates.begin(), candidates.begin() + k, candidates.end(), comes_before);
  ordered.assign(candidates.begin(), candidates.begin() + k);
}

// The truncated draw under top-k: top-p against the top-k mass, then min-p against the maximum's mass, 1.
int64_t draw_top_k(const RowMasses& masses, const RowRule& rule, std::vector<Candidate>& candidates,
                   std::vector<Candidate>& ordered) {
  top_k_tokens(masses, rule.top_k, candidates, ordered);
  double top_mass = 0.0;
  for (const Candidate& candidate : ordered) top_mass += candidate.first;
  const double p_limit = rule.top_p * top_mass;
  double cumulative = 0.0;
  size_t kept = 0;
  for (; kept < ordered.size(); ++kept) {
    const float mass = ordered[kept].first;
    if (kept > 0 && (cumulative >= p_limit || mass < rule.min_p)) break;
    cumulative += mass;
  }
  return pick(ordered, kept, rule.uniform * cumulative);
}

// Does a running mass of `running` reach `target`: exceed it, or for `inclusive` at least equal it?
inline bool reaches(double running, double target, bool inclusive) {
  return inclusive ? running >= target : running > target;
}

// The first of [first, last) in the order largest mass first (the lowest token among equal masses) at which
// the running mass reaches `target` (see reaches); where rounding leaves none, the last in that order. A
// selection, not a sort: it rearranges the range so that every candidate before the one returned comes
// before it in that order, and every one after it, after. Each round splits the range around a pivot and
// keeps the side that holds the target, so a row costs a few passes over its candidates however many are
// kept: ordering the kept ones (a heap of every token within 1e-8 of the maximum's mass, popped thousands
// of times) took up to 2.4 ms a row over the flat rows of random-token prompts, 12 ms a batch-32 draw.
Candidate* weighted_select(Candidate* first, Candidate* last, double target, bool inclusive) {
  constexpr auto before = comes_before;
  Candidate* const whole_end = last;
  constexpr ptrdiff_t SMALL = 16;
  while (last - first > SMALL) {
    Candidate* middle = first + (last - first) / 2;
    // the median of three as pivot, moved to the front
    if (before(*middle, *first)) std::iter_swap(middle, first);
    if (before(last[-1], *first)) std::iter_swap(last - 1, first);
    if (before(last[-1], *middle)) std::iter_swap(last - 1, middle);
    std::iter_swap(first, middle);
    const Candidate pivot = *first;
    Candidate* split = std::partition(first + 1, last, [&](const Candidate& c) { return before(c, pivot); });
    std::iter_swap(first, split - 1);  // the pivot between the two sides
    Candidate* const at_pivot = split - 1;
    double upper = 0.0;
    for (Candidate* c = first; c < at_pivot; ++c) upper += c->first;
    if (at_pivot > first && reaches(upper, target, inclusive)) {
      last = at_pivot;
      continue;
    }
    target -= upper;
    if (reaches(pivot.first, target, inclusive)) return at_pivot;
    target -= pivot.first;
    first = split;
  }
  std::sort(first, last, before);
  for (Candidate* c = first; c < last; ++c) {
    if (reaches(c->first, target, inclusive)) return c;
    target -= c->first;
  }
  // rounding reached none: the last of the whole range in that order (every one past `last` comes after
  // those before it)
  return last == whole_end ? last - 1 : std::max_element(last, whole_end, before);
}

// The truncated draw without top-k. Only tokens within a factor of the maximum's mass are collected; the
// kept prefix, largest first, ends where the running mass reaches top-p's limit (the first token is always
// kept), and min-p keeps only tokens of at least min_p times the maximum's mass, 1. Both cuts and then the
// draw are weighted selections over the collected tokens.
int64_t draw_top_p(const RowMasses& masses, const RowRule& rule, std::vector<Candidate>& candidates) {
  const float* e = masses.e.data();
  const auto vocab = static_cast<int64_t>(masses.e.size());
  const double p_limit = rule.top_p * masses.total;
  for (float factor : COLLECT_FACTORS) {
    const float floor = std::max(factor, rule.min_p);
    candidates.clear();
    double collected = 0.0;
    for (int64_t start = 0; start < vocab; start += BLOCK) {
      const int64_t end = std::min(start + BLOCK, vocab);
      if (masses.block_max[start / BLOCK] < floor || masses.block_max[start / BLOCK] <= 0.f) continue;
      for (int64_t i = start; i < end; ++i) {
        if (e[i] >= floor && e[i] > 0.f) {
          candidates.emplace_back(e[i], i);
          collected += e[i];
        }
      }
    }
    // an uncollected token has less mass than every collected one, and less than factor: it is cut if the
    // collected ones reach top-p's limit, or if min-p cuts below factor
    const bool ended = factor == 0.f || collected >= p_limit || (rule.min_p > 0.f && rule.min_p >= factor);
    if (!ended) continue;
    if (candidates.empty()) return 0;  // no token has mass (non-finite logits): nothing to draw from
    Candidate* const first = candidates.data();
    Candidate* const last_kept = weighted_select(first, first + candidates.size(), p_limit, true);
    double kept_mass = 0.0;
    for (Candidate* c = first; c <= last_kept; ++c) kept_mass += c->first;
    return weighted_select(first, last_kept + 1, rule.uniform * kept_mass, false)->second;
  }
  return 0;  // not reached: the last factor collects every token with mass
}

int64_t sample_row(const float* x, int64_t vocab, const RowRule& rule) {
  if (rule.temperature == 0.f) return argmax(x, vocab);
  thread_local RowMasses masses;
  thread_local std::vector<Candidate> candidates, ordered;
  fill_masses(x, vocab, 1.f / rule.temperature, masses);
  const bool truncates = rule.top_k < vocab || rule.top_p < 1.f || rule.min_p > 0.f;
  if (!truncates) return walk(masses.e.data(), vocab, rule.uniform * masses.total);
  if (rule.top_k < vocab) return draw_top_k(masses, rule, candidates, ordered);
  return draw_top_p(masses, rule, candidates);
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
