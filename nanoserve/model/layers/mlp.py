"""GatedMLP: down(act(gate(x)) * up(x)) with gate and up fused in one matmul; silu (Llama) or gelu-tanh
(GeGLU, Gemma)."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from nanoserve.model.layers.linear import Linear

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
"""HF hidden_act names map here in nanoserve.model.config (gelu_pytorch_tanh -> gelu_tanh)."""


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.activation = activation

    kernel: Callable | None = None
    """The C++ silu_and_mul / gelu_tanh_and_mul (nanoserve.model.kernels): one pass where PyTorch runs three ops."""

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernel is not None and gate_up.dim() == 2:
            return self.down_proj(self.kernel(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(ACTIVATIONS[self.activation](gate) * up)
