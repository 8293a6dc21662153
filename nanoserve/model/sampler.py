"""Sampler: logits of the batch's last positions -> one token per request (plus logprobs when asked).

All-greedy batches take an argmax fast path. A seeded request draws from its own generator, so its
tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from nanoserve.model.batch import SequenceState


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: list[SequenceState]) -> tuple[list[int], list]:
        """logits: float32 [num_requests, vocab], one row per request in `requests`."""
        params = [r.sampling_params for r in requests]
        raw_logits = logits
        if any(_has_penalty(p) for p in params):
            logits = _apply_penalties(logits.clone(), requests)
        if any(
            p.min_tokens and r.num_output_tokens < p.min_tokens for p, r in zip(params, requests, strict=True)
        ):
            logits = _suppress_stops(logits if logits is not raw_logits else logits.clone(), requests)

        if all(p.is_greedy for p in params):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample_random(logits, requests)
        token_list = token_ids.tolist()
        return token_list, _logprobs(raw_logits, token_ids, requests)

    def _sample_random(self, logits: torch.Tensor, requests: list[SequenceState]) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        greedy = torch.tensor([p.is_greedy for p in params])
        temperature = torch.tensor(
            [1.0 if p.is_greedy else p.temperature for p in params], dtype=logits.dtype
        )
        logits = logits / temperature.unsqueeze(1)
        logits = _top_k_top_p_min_p(logits, params)
        probs = torch.softmax(logits, dim=-1)
        # Exponential race: argmax(p / q) with q ~ Exp(1) is a draw from p, and each seeded row draws
        # its noise from its own generator.
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for i, request in enumerate(requests):
            if request.generator is not None:
                noise[i].exponential_(generator=request.generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)


def _has_penalty(p) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _apply_penalties(logits: torch.Tensor, requests: list[SequenceState]) -> torch.Tensor:
    num_rows, vocab = logits.shape
    output_counts = torch.zeros(num_rows, vocab, dtype=logits.dtype)
    seen = torch.zeros(num_rows, vocab, dtype=torch.bool)
    for i, r in enumerate(requests):
        if r.output_token_ids:
            ids = torch.tensor(r.output_token_ids)
            output_counts[i].index_add_(0, ids, torch.ones(len(ids), dtype=logits.dtype))
        if r.sampling_params.repetition_penalty != 1.0:
            seen[i, torch.tensor(r.all_token_ids)] = True
    rep = torch.tensor(
        [r.sampling_params.repetition_penalty for r in requests], dtype=logits.dtype
    ).unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    freq = torch.tensor(
        [r.sampling_params.frequency_penalty for r in requests], dtype=logits.dtype
    ).unsqueeze(1)
    pres = torch.tensor([r.sampling_params.presence_penalty for r in requests], dtype=logits.dtype).unsqueeze(
        1
    )
    return logits - freq * output_counts - pres * (output_counts > 0).to(logits.dtype)


def _suppress_stops(logits: torch.Tensor, requests: list[SequenceState]) -> torch.Tensor:
    """Before min_tokens are out, EOS and stop tokens cannot be sampled."""
    for i, r in enumerate(requests):
        p = r.sampling_params
        if r.num_output_tokens >= p.min_tokens:
            continue
        stops = list(p.stop_token_ids or [])
        if not p.ignore_eos:
            stops.extend(r.eos_token_ids)
        if stops:
            logits[i, stops] = float("-inf")
    return logits


def _top_k_top_p_min_p(logits: torch.Tensor, params: list) -> torch.Tensor:
    vocab = logits.shape[-1]
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if all(k >= vocab for k in top_k) and all(p >= 1.0 for p in top_p) and not any(min_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= torch.tensor(top_k).unsqueeze(1)
    probs = torch.softmax(sorted_logits, dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the token that crosses it is kept)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= torch.tensor(top_p, dtype=probs.dtype).unsqueeze(1)
    drop |= probs < torch.tensor(min_p, dtype=probs.dtype).unsqueeze(1) * probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor, requests: list[SequenceState]) -> list:
    """Per request: [(sampled, logprob), (top1, logprob), ...] of the model's raw distribution, or None."""
    wanted = [r.sampling_params.logprobs for r in requests]
    if all(n is None for n in wanted):
        return [None] * len(requests)
    rows = [i for i, n in enumerate(wanted) if n is not None]
    logprobs = torch.log_softmax(raw_logits[rows], dim=-1)
    max_n = max(wanted[i] or 0 for i in rows)
    top_values, top_ids = logprobs.topk(max_n, dim=-1) if max_n else (None, None)
    sampled = token_ids[rows]
    sampled_lp = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
    result: list = [None] * len(requests)
    for j, i in enumerate(rows):
        entry = [(int(sampled[j]), sampled_lp[j])]
        if wanted[i] and top_ids is not None and top_values is not None:
            entry += list(
                zip(top_ids[j, : wanted[i]].tolist(), top_values[j, : wanted[i]].tolist(), strict=True)
            )
        result[i] = entry
    return result
