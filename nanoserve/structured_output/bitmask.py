"""Token bitmasks: one bit per vocabulary entry (bit i of int32 word w allows token 32 * w + i)."""

from __future__ import annotations

import torch

BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of tokens the bitmask forbids.

    logits: [num_rows, vocab]; bitmask: int32 [len(rows), ceil(vocab / 32)], one row per entry of rows.
    """
    vocab = logits.shape[-1]
    allowed = ((bitmask.unsqueeze(-1) >> BITS) & 1).bool()  # [len(rows), words, 32]
    allowed = allowed.flatten(1)[:, :vocab]
    index = torch.tensor(rows)
    logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))
