"""Linear: nn.Linear whose steps can run on a faster kernel than F.linear (on CPU: oneDNN over a pre-packed
bf16 weight, or the C++ dense_matmul over a float32 one) and that can carry a quantized copy."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nanoserve.model.quant import QuantizedWeight

DenseMatmul = Callable[[Tensor, Tensor, Tensor | None], Tensor]
"""The C++ dense_matmul(x, weight, bias) of float32 steps (nanoserve/model/kernels/dense_matmul.cpp)."""
RowsMatmul = Callable[[Tensor, Tensor, Tensor | None, int], Tensor]
"""The C++ packed_linear_by_rows(x, packed, bias, out_features) (nanoserve/model/kernels/packed_linear.cpp)."""


def cpu_prepack_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_weight(weight: Tensor, batch_hint: int = 1) -> Tensor:
    """The weight in the blocked layout oneDNN picks for steps of batch_hint rows (nanoserve.model.pack_choice)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear that can keep its weight pre-packed for oneDNN on CPU.

    F.linear in bf16 on CPU re-packs the weight into oneDNN's blocked layout on every call, which at
    decode batch sizes costs about as much as the matmul; packing once makes small batches ~1.5-4x faster.
    In float32, torch's matmul reads a weight at half the memory's speed or less for a few rows, so steps
    run on dense_matmul, all of them: a row's result then never depends on the step's size (with torch's
    matmul for large steps, a prompt prefilled beside others could decode other greedy tokens than alone).
    Every Linear of a decoder layer is quantized by --quantization (routers are plain nn.Linear, kept
    exact: they choose experts).
    """

    packed: Tensor | None = None
    dense: DenseMatmul | None = None
    """float32: the matmul of every step (see nanoserve/model/kernels/dense_matmul.cpp)."""
    plain_from: int = sys.maxsize
    """Steps of at least this many rows multiply the plain weight, which oneDNN lays out for their size on
    every call: for compute-bound prefill steps that can beat the packed layout (nanoserve.model.pack_choice)."""
    split_from: int = sys.maxsize
    """Steps of at least this many rows run the packed weight by rows (`by_rows`): each thread multiplies
    its own share of the rows on oneDNN alone, which for a small model's prefill steps can beat oneDNN's own
    split of the call (nanoserve.model.pack_choice)."""
    by_rows: RowsMatmul | None = None
    quantized: QuantizedWeight | None = None
    """Used for steps of up to quantized.max_tokens rows (see nanoserve.model.quant)."""

    batch_hint: int = 1
    """The step size oneDNN laid `packed` out for."""

    def prepack(self, batch_hint: int = 1) -> None:
        self.packed = pack_weight(self.weight, batch_hint)
        self.batch_hint = batch_hint

    def forward(self, input: Tensor) -> Tensor:  # nn.Linear's name for it
        if self.quantized is not None and input.shape[0] <= self.quantized.max_tokens:
            out = self.quantized.matmul(input)
            return out if self.bias is None else out + self.bias
        return self.unquantized(input)

    @property
    def quantized_serves_every_step(self) -> bool:
        """Whether the quantized copy serves steps of every size, so that no step reads the packed weight."""
        return self.quantized is not None and self.quantized.max_tokens == sys.maxsize

    def bytes_read(self, num_tokens: int) -> int:
        """Weight bytes a step of num_tokens rows reads: the quantized copy's where it serves the step."""
        bias = 0 if self.bias is None else self.bias.nbytes
        if self.quantized is not None and num_tokens <= self.quantized.max_tokens:
            return self.quantized.nbytes + bias
        return self.weight.nbytes + bias

    def unquantized(self, input: Tensor, with_bias: bool = True) -> Tensor:
        bias = self.bias if with_bias else None
        if self.dense is not None:
            return self.dense(input, self.weight, bias)
        if self.packed is not None and self.by_rows is not None and input.shape[0] >= self.split_from:
            return self.by_rows(input, self.packed, bias, self.out_features)
        if self.packed is not None and input.shape[0] < self.plain_from:
            return packed_linear(input, self.packed, bias)
        return F.linear(input, self.weight, bias)
