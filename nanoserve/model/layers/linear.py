"""Linear: nn.Linear that can keep its weight pre-packed for oneDNN (CPU, bf16) and carry a quantized copy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nanoserve.model.quant import QuantizedWeight


def cpu_prepack_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_weight(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)  # 1: tuned for decode-sized batches


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear that can keep its weight pre-packed for oneDNN on CPU.

    F.linear in bf16 on CPU re-packs the weight into oneDNN's blocked layout on every call, which at
    decode batch sizes costs about as much as the matmul; packing once makes small batches ~1.5-4x faster.
    Every Linear of a decoder layer is quantized by --quantization (routers are plain nn.Linear, kept
    exact: they choose experts).
    """

    packed: Tensor | None = None
    quantized: QuantizedWeight | None = None
    """Used for steps of up to quantized.max_tokens rows (see nanoserve.model.quant)."""

    def prepack(self) -> None:
        self.packed = pack_weight(self.weight)

    def forward(self, input: Tensor) -> Tensor:  # nn.Linear's name for it
        if self.quantized is not None and input.shape[0] <= self.quantized.max_tokens:
            out = self.quantized.matmul(input)
            return out if self.bias is None else out + self.bias
        if self.packed is not None:
            return packed_linear(input, self.packed, self.bias)
        return F.linear(input, self.weight, self.bias)
