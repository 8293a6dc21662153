"""RMSNorm, with the C++ kernel on CPU.

Gemma's norms scale by (1 + w): its loader stores 1 + w (as llama.cpp's GGUF converter does), so one
norm serves every family and the kernel needs no variant.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    kernel: Callable | None = None
    """The C++ rms_norm (nanoserve.model.kernels): one op where PyTorch's CPU rms_norm runs eight."""

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel is not None and x.dim() == 2:
            return self.kernel(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
