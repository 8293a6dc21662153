// oneDNN's matmul over a pre-packed bf16 weight (what torch.ops.mkldnn._linear_pointwise runs), whole or
// by rows.
//
// oneDNN shares one call among the threads itself, and for the prefill-sized steps of a small model it
// shares them poorly: on a two-core AMX Xeon, 512 rows of SmolLM2's qkv ran 1.2x faster on two threads
// than on one, and its down_proj 1.5x. By rows, each thread multiplies its own share of the rows with
// oneDNN planned for one thread, reading the whole weight. Which steps run by rows is measured per CPU and
// shape (nanoserve/model/pack_choice.py); on that Xeon, qkv and down_proj from 512 and 256 rows took a
// 512-token prefill from 94 to 88 ms. A row's result depends on the size of its share (oneDNN rounds a
// two-thread call and a one-thread call differently at some sizes), so the module path and the fused one
// both call this function.
#include "kernels.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <omp.h>

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

at::Tensor packed_linear_by_rows(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                                 int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "packed_linear_by_rows: x [rows, in_features]");
  const int64_t rows = x.size(0);
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), rows));
  if (threads < 2 || at::in_parallel_region()) return packed_linear(x, packed, bias);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  const at::ThreadLocalState caller;  // grad and inference mode, as the caller's thread has them
  const int64_t share = (rows + threads - 1) / threads;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    const at::ThreadLocalStateGuard state(caller);
    omp_set_num_threads(1);  // oneDNN plans the call for the threads it will have: this one
    const int64_t first = omp_get_thread_num() * share, count = std::min(share, rows - first);
    try {
      if (count > 0) out.narrow(0, first, count).copy_(packed_linear(x.narrow(0, first, count), packed, bias));
    } catch (...) {
#pragma omp critical
      error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  return out;
}
