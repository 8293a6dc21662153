"""The caller's hard controls on what may be sampled: logit_bias, allowed_token_ids, bad_words and a
structured output's grammar bitmask, applied to the logits before the draw.

Each is one batched op over the rows that use it (index lists gathered in Python, one scatter or
masked fill in torch); rows that use none cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoserve.model.batch import SampledSequence
from nanoserve.sampling_params import SamplingParams
from nanoserve.structured_output.bitmask import apply_bitmask

NEG_INF = float("-inf")


def has_logits_controls(p: SamplingParams) -> bool:
    return p.logit_bias is not None or p.allowed_token_ids is not None or p.bad_words_token_ids is not None


def apply_logits_controls(
    logits: torch.Tensor, requests: Sequence[SampledSequence], grammar_bitmask: torch.Tensor | None
) -> None:
    """In place on logits [num_requests, vocab]; grammar_bitmask has one row per request with a grammar."""
    _add_logit_bias(logits, requests)
    _keep_allowed(logits, requests)
    _ban_bad_words(logits, requests)
    if grammar_bitmask is not None:
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        apply_bitmask(logits, rows, grammar_bitmask)


def _add_logit_bias(logits: torch.Tensor, requests: Sequence[SampledSequence]) -> None:
    rows, cols, values = [], [], []
    for i, r in enumerate(requests):
        bias = r.sampling_params.logit_bias
        if bias:
            rows.extend([i] * len(bias))
            cols.extend(bias)
            values.extend(bias.values())
    if rows:
        logits.index_put_(
            (torch.tensor(rows), torch.tensor(cols)),
            torch.tensor(values, dtype=logits.dtype),
            accumulate=True,
        )


def _keep_allowed(logits: torch.Tensor, requests: Sequence[SampledSequence]) -> None:
    rows = [i for i, r in enumerate(requests) if r.sampling_params.allowed_token_ids is not None]
    if not rows:
        return
    banned = torch.ones(len(rows), logits.shape[-1], dtype=torch.bool)
    mask_rows, cols = [], []
    for j, i in enumerate(rows):
        allowed = requests[i].sampling_params.allowed_token_ids or []
        mask_rows.extend([j] * len(allowed))
        cols.extend(allowed)
    banned[torch.tensor(mask_rows), torch.tensor(cols)] = False
    index = torch.tensor(rows)
    logits[index] = logits[index].masked_fill_(banned, NEG_INF)


def _ban_bad_words(logits: torch.Tensor, requests: Sequence[SampledSequence]) -> None:
    """A bad word's last token is banned where the output so far ends with the rest of the word."""
    rows, cols = [], []
    for i, r in enumerate(requests):
        for word in r.sampling_params.bad_words_token_ids or ():
            prefix = word[:-1]
            if not prefix or r.output_token_ids[-len(prefix) :] == prefix:
                rows.append(i)
                cols.append(word[-1])
    if rows:
        logits[torch.tensor(rows), torch.tensor(cols)] = NEG_INF
