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
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

inline thread_local bool in_decode_region = false;
inline thread_local bool owes_barrier = false;  // thread 0 ran a loop alone since the last barrier

// Marks this thread as inside FusedDecoder's region for its lifetime.
struct DecodeRegion {
  DecodeRegion() { in_decode_region = true; }
  ~DecodeRegion() { in_decode_region = owes_barrier = false; }  // the region's end is a barrier
  DecodeRegion(const DecodeRegion&) = delete;
  DecodeRegion& operator=(const DecodeRegion&) = delete;
};

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
  if (owes_barrier) {
#pragma omp barrier
    owes_barrier = false;
  }
  const int64_t chunk = (count + threads - 1) / threads;
  const int64_t first = begin + omp_get_thread_num() * chunk;
  if (first < end) f(first, std::min(end, first + chunk));
#pragma omp barrier
}
