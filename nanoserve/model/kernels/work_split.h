// split_work: how the kernels share a loop among threads, in and out of a decode region.
//
// Outside a region it is at::parallel_for: each call opens an OpenMP parallel region. A decode step of a
// small model makes hundreds of such calls with a few microseconds of work each, and opening a region,
// waking the other threads and allocating each call's outputs cost about as much as that work. So
// FusedDecoder runs a whole small decode step inside one region (DecodeRegion): every thread makes the
// same kernel calls in the same order over shared buffers, and each call takes this thread's share of the
// loop, cut exactly as at::parallel_for cuts it, then waits at a barrier for the others. The per-element
// arithmetic is the same either way, so are the results, bit for bit.
//
// A loop under its grain runs on thread 0 alone (at batch 1: the norms, the activations' quantization,
// rotary, the residual adds), and a run of such loops needs no barrier between them: thread 0 sees its own
// writes. The others meet it once, before the next loop they share: at batch 1 a decode layer meets 10 or 11
// barriers instead of 17.
//
// The matmuls' loops (split_balanced) are cut by speed, not evenly. Cores do not all run at one speed: on a
// shared VM one core took 1.4x as long as the other over the same weights for seconds at a time, and on a
// hybrid CPU an efficiency core is slower for good. With equal shares the fast thread waits at every
// barrier. Each balanced loop times each thread's share, and the next one is cut in proportion to the
// speeds learned so far. Each output column is computed the same way whichever thread computes it, so the
// results do not change, bit for bit.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// How fast each thread of a region gets through a loop's items, relative to the others: the log of its
// items per second less the threads' mean, an exponential average over the loops timed so far.
class ThreadSpeeds {
 public:
  static constexpr int MAX_THREADS = 64;

  ThreadSpeeds() = default;

  // thread's part of [begin, end) when `threads` threads share it in proportion to their speeds. Thread t
  // ends where thread t + 1 starts because both round the same stored boundary: summing the speeds here,
  // per thread, would let the compiler sum them in a different order on each (fast-math) and lose a tile.
  std::pair<int64_t, int64_t> share(int thread, int threads, int64_t begin, int64_t end) const {
    if (threads != threads_) return ThreadSpeeds(threads).share(thread, threads, begin, end);  // even, as yet
    const auto cut = [&](int boundary) {
      return begin + std::llround(static_cast<double>(end - begin) * boundaries_[boundary]);
    };
    return {cut(thread), cut(thread + 1)};
  }

  // One loop's seconds per item by thread (0: a thread that had no items, and nothing is learned); the
  // speeds move a tenth of the way toward that loop's. One loop counts for no more than MAX_LOG either way,
  // so a thread pre-empted once does not lose its share for the next twenty loops.
  void learn(const double* seconds_per_item, int threads) {
    if (threads != threads_) *this = ThreadSpeeds(threads);
    std::array<double, MAX_THREADS> log_speed;
    double mean = 0;
    for (int t = 0; t < threads; ++t) {
      if (seconds_per_item[t] <= 0) return;
      log_speed[t] = -std::log(seconds_per_item[t]);
      mean += log_speed[t] / threads;
    }
    for (int t = 0; t < threads; ++t)
      log_speed_[t] += LEARNING_RATE * (std::clamp(log_speed[t] - mean, -MAX_LOG, MAX_LOG) - log_speed_[t]);
    settle();
  }

  // each thread's speed over the threads' geometric mean (empty before any loop is timed)
  std::vector<double> relative() const {
    std::vector<double> ratios;
    for (int t = 0; t < threads_; ++t) ratios.push_back(std::exp(log_speed_[t]));
    return ratios;
  }

  // speeds set by hand, as ratios to one another (tests cut loops unevenly with it)
  void set_relative(const std::vector<double>& ratios) {
    TORCH_CHECK_VALUE(ratios.size() <= MAX_THREADS, "ThreadSpeeds: at most ", MAX_THREADS, " threads");
    *this = ThreadSpeeds(static_cast<int>(ratios.size()));
    for (int t = 0; t < threads_; ++t) {
      TORCH_CHECK_VALUE(ratios[t] > 0, "ThreadSpeeds: speeds must be positive");
      log_speed_[t] = std::log(ratios[t]);
    }
    settle();
  }

 private:
  static constexpr double LEARNING_RATE = 0.1;
  static constexpr double MAX_LOG = 1.1;  // 3x faster or slower than the mean, before centring

  explicit ThreadSpeeds(int threads) : threads_(threads) { settle(); }

  // the log speeds clamped and centred on 0, and the boundaries between the threads' shares from them
  void settle() {
    double mean = 0;
    for (int t = 0; t < threads_; ++t) {
      log_speed_[t] = std::clamp(log_speed_[t], -MAX_LOG, MAX_LOG);
      mean += log_speed_[t] / threads_;
    }
    std::array<double, MAX_THREADS> speed;
    double total = 0;
    for (int t = 0; t < threads_; ++t) {
      log_speed_[t] -= mean;
      speed[t] = std::exp(log_speed_[t]);
      total += speed[t];
    }
    double before = 0;
    for (int t = 0; t < threads_; ++t) {
      boundaries_[t] = before / total;
      before += speed[t];
    }
    boundaries_[threads_] = 1;
  }

  int threads_ = 0;
  std::array<double, MAX_THREADS> log_speed_{};
  std::array<double, MAX_THREADS + 1> boundaries_{};  // where each thread's share starts, as a fraction; 1 last
};

// Where the threads of a decode region meet between loops. libgomp's barrier has its last thread make a
// futex_wake system call every time, whether or not a thread sleeps: on a two-core AMD EPYC Zen 3 (KVM)
// that held the last thread 0.5 us a barrier, on the critical path of the ~300 barriers of a batch-1
// decode step. Here the last thread only moves the generation on. The others spin, then yield their core
// after SPINS pauses, as libgomp's own waits spin before they sleep: a thread of another process (the
// frontend's) may need it.
class RegionBarrier {
 public:
  void wait(int threads) {
    const uint32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (spins < SPINS)
        pause();
      else
        std::this_thread::yield();
    }
  }

 private:
  static constexpr int SPINS = 20000;

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};
};

// What the threads of a region share: their barrier, and what cuts their balanced loops: the speeds
// learned in earlier regions and each thread's time per item on the last two loops (two: a thread may
// start a loop while another still reads the last one's times).
struct RegionShared {
  RegionBarrier barrier;
  ThreadSpeeds learned;
  std::array<std::array<double, ThreadSpeeds::MAX_THREADS>, 2> seconds_per_item{};
};

inline thread_local bool in_decode_region = false;
inline thread_local bool owes_barrier = false;  // thread 0 ran a loop alone since the last barrier
inline thread_local RegionShared* region_shared = nullptr;
// This thread's copy of the speeds: every thread starts from the same `learned` and updates its copy from
// the same times, so all cut each loop at the same points without a word between them.
inline thread_local ThreadSpeeds region_speeds;
inline thread_local int64_t balanced_loops = 0;

// Marks this thread as inside FusedDecoder's region for its lifetime, with what the region's threads share.
struct DecodeRegion {
  explicit DecodeRegion(RegionShared& shared) {
    in_decode_region = true;
    region_shared = &shared;
    region_speeds = shared.learned;
    balanced_loops = 0;
  }
  ~DecodeRegion() {  // the region's end is a barrier
    in_decode_region = owes_barrier = false;
    region_shared = nullptr;
  }
  DecodeRegion(const DecodeRegion&) = delete;
  DecodeRegion& operator=(const DecodeRegion&) = delete;
};

// the region's threads meet
inline void region_barrier() { region_shared->barrier.wait(omp_get_num_threads()); }

// before a loop the threads share: meet thread 0 if it ran loops alone since the last barrier
inline void meet_if_owed() {
  if (!owes_barrier) return;
  region_barrier();
  owes_barrier = false;
}

// f(begin, end) over [begin, end) in chunks of at least `grain`, as at::parallel_for runs it.
template <typename F>
void split_work(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (!in_decode_region) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t count = end - begin;
  // at::parallel_for's cut: one chunk per thread, no chunk under grain (a loop under grain: one thread)
  const int64_t threads = count > grain ? std::min<int64_t>(omp_get_num_threads(), (count + grain - 1) / grain) : 1;
  if (threads == 1) {
    if (count > 0 && omp_get_thread_num() == 0) f(begin, end);
    owes_barrier = true;
    return;
  }
  meet_if_owed();
  const int64_t chunk = (count + threads - 1) / threads;
  const int64_t first = begin + omp_get_thread_num() * chunk;
  if (first < end) f(first, std::min(end, first + chunk));
  region_barrier();
}

// split_work for loops whose items all cost the same (a matmul's column tiles): in a region, with enough
// items for every thread, each thread's share is in proportion to its speed, and the speeds are learned
// from the time each share took.
template <typename F>
void split_balanced(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int threads = in_decode_region ? omp_get_num_threads() : 1;
  if (threads < 2 || threads > ThreadSpeeds::MAX_THREADS || end - begin < threads * grain) {
    split_work(begin, end, grain, f);
    return;
  }
  meet_if_owed();
  const int thread = omp_get_thread_num();
  const auto [first, last] = region_speeds.share(thread, threads, begin, end);
  const auto start = std::chrono::steady_clock::now();
  if (first < last) f(first, last);
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  double* seconds_per_item = region_shared->seconds_per_item[balanced_loops++ % 2].data();
  seconds_per_item[thread] = first < last ? took.count() / static_cast<double>(last - first) : 0;
  region_barrier();
  region_speeds.learn(seconds_per_item, threads);
  if (thread == 0) region_shared->learned = region_speeds;  // every thread copied it before this barrier
}
