"""Token bitmasks: one bit per vocabulary entry (bit i of int32 word w allows token 32 * w + i)."""

from __future__ import annotations

import numpy as np
import torch


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of tokens the bitmask forbids.

    logits: [num_rows, vocab]; bitmask: int32 [len(rows), ceil(vocab / 32)] on the CPU, one row per
    entry of rows. numpy unpacks the bits in one pass (the words are little-endian, so byte k of word w
    holds tokens 32 * w + 8 * k onwards), far cheaper than shifting every word by 32 amounts in torch.
    """
    vocab = logits.shape[-1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, count=vocab, bitorder="little")
    forbidden = (torch.from_numpy(bits) == 0).to(logits.device)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(forbidden, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill_(forbidden, float("-inf"))
