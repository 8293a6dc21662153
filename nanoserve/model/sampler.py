"""Sampler: logits of the batch's last positions -> one token per request (plus logprobs when asked).

All-greedy batches take an argmax fast path. Sampled rows draw by inverse CDF: one uniform per row
per step, so a seeded request, which draws from its own generator, gets tokens that do not depend on
what else is in the batch, and its stream after k sampled tokens is its seed's generator after k
draws of `torch.rand(1)` (which `torch.rand(k)` also reaches).

Speculative decoding (`sample_and_verify`): a request with d draft tokens has d + 1 rows, row j for
the position after its first j drafts, and each row is sampled as plain decoding would sample it once
those drafts are its output (penalties, min_tokens, bad words and the grammar's mask see them). The
drafts are kept up to the first one that differs from the token sampled at its position, and that
token follows them. Since a draft is a single guess (a point mass), this is the standard rejection
rule: a draft is accepted with probability p(draft), and a rejected position's token is drawn from p
without the draft, renormalized. Drawing each row with the uniform plain decoding would have used
there keeps more than the distribution: a seeded request's tokens are the very tokens it gets without
speculation, greedy ones trivially so. Its generator is wound back to one draw per kept token, so the
contract above holds for what it outputs, and a replay after an engine restart stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from nanoserve.model.batch import SampledSequence, TokenLogprobs
from nanoserve.model.logits_controls import apply_logits_controls, has_logits_controls
from nanoserve.sampling_params import SamplingParams

CANDIDATES = 64
"""Top tokens a truncating row looks at first: on SmolLM2 text at temperature 0.8, top-p 0.95 keeps a
median of 10 tokens and more than 256 in 1% of rows."""


class DraftedSequence:
    """A sequence as it stands once its first draft tokens are accepted: the sampler's view of the
    position after them (its token lists are built only if a penalty or bad word reads them)."""

    def __init__(self, sequence: SampledSequence, accepted: list[int]) -> None:
        self.sequence = sequence
        self.accepted = accepted
        self.sampling_params = sequence.sampling_params
        self.eos_token_ids = sequence.eos_token_ids
        self.generator = sequence.generator
        self.grammar = sequence.grammar

    @property
    def all_token_ids(self) -> list[int]:
        return self.sequence.all_token_ids + self.accepted

    @property
    def output_token_ids(self) -> list[int]:
        return self.sequence.output_token_ids + self.accepted

    @property
    def num_output_tokens(self) -> int:
        return self.sequence.num_output_tokens + len(self.accepted)


class Sampler:
    def __init__(self, seed: int, kernels: ModuleType | None = None) -> None:
        """kernels: nanoserve.model.kernels' module, whose `sample_rows` draws every row in one call
        (the same rules as the PyTorch path below, in a few passes over each row instead of a dozen ops
        over the batch); None: PyTorch ops."""
        self.generator = torch.Generator().manual_seed(seed)
        self.kernels = kernels

    def sample(
        self,
        logits: torch.Tensor,
        requests: Sequence[SampledSequence],
        grammar_bitmask: torch.Tensor | None = None,
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: float32 [num_requests, vocab], one row per request in `requests`; grammar_bitmask:
        one row per request with a grammar, in order (see nanoserve.structured_output)."""
        token_ids, raw_logits, _ = self._sample_rows(logits, requests, grammar_bitmask, None)
        return token_ids.tolist(), _logprobs(raw_logits, token_ids, requests)

    def sample_and_verify(
        self,
        logits: torch.Tensor,
        requests: Sequence[SampledSequence],
        drafts: list[list[int]],
        grammar_bitmask: torch.Tensor | None = None,
    ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """logits: float32 [sum(1 + len(d) for d in drafts), vocab], request after request, row j of a
        request for the position after its first j drafts; grammar_bitmask likewise, for the requests
        with a grammar. Returns per request the tokens it keeps (accepted drafts, then one sampled
        token) and their logprobs."""
        rows: list[SampledSequence] = []
        spans: list[tuple[int, int]] = []
        for request, draft in zip(requests, drafts, strict=True):
            spans.append((len(rows), len(draft) + 1))
            rows.append(request)
            rows.extend(DraftedSequence(request, draft[:j]) for j in range(1, len(draft) + 1))
        token_ids, raw_logits, rewinds = self._sample_rows(logits, rows, grammar_bitmask, spans)
        sampled = token_ids.tolist()
        kept: list[list[int]] = []
        kept_rows: list[int] = []
        for (start, _), draft in zip(spans, drafts, strict=True):
            num_accepted = 0
            while num_accepted < len(draft) and sampled[start + num_accepted] == draft[num_accepted]:
                num_accepted += 1
            kept.append(sampled[start : start + num_accepted + 1])
            kept_rows.extend(range(start, start + num_accepted + 1))
        for i, generator, state in rewinds:
            if len(kept[i]) < spans[i][1]:  # one draw per kept token, as without drafts
                generator.set_state(state)
                torch.rand(len(kept[i]), generator=generator)
        all_logprobs = _logprobs(raw_logits, token_ids, rows)
        row_logprobs = [all_logprobs[k] for k in kept_rows]
        logprobs: list[list[TokenLogprobs] | None] = []
        start = 0
        for request, tokens in zip(requests, kept, strict=True):
            entries = row_logprobs[start : start + len(tokens)]
            start += len(tokens)
            logprobs.append(
                None if request.sampling_params.logprobs is None else [e for e in entries if e is not None]
            )
        return kept, logprobs

    def _sample_rows(
        self,
        logits: torch.Tensor,
        requests: Sequence[SampledSequence],
        grammar_bitmask: torch.Tensor | None,
        spans: list[tuple[int, int]] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, torch.Generator, torch.Tensor]]]:
        """One token per row; also the raw logits (for logprobs) and, for seeded requests of several
        rows (spans: per request its first row and row count), their generators' states before the draw."""
        params = [r.sampling_params for r in requests]
        raw_logits = logits
        if any(_has_penalty(p) for p in params):
            logits = _apply_penalties(logits.clone(), requests)
        if any(
            p.min_tokens and r.num_output_tokens < p.min_tokens for p, r in zip(params, requests, strict=True)
        ):
            logits = _suppress_stops(logits if logits is not raw_logits else logits.clone(), requests)
        if any(has_logits_controls(p) for p in params) or grammar_bitmask is not None:
            logits = logits if logits is not raw_logits else logits.clone()
            apply_logits_controls(logits, requests, grammar_bitmask)

        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        in_kernel = self.kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
        if not rows:  # torch's rule and the kernel's: the first index of the maximum
            if in_kernel:
                return self.kernels.greedy_rows(logits.contiguous()), raw_logits, []
            return logits.argmax(dim=-1), raw_logits, []
        uniforms, rewinds = self._uniforms(requests, spans or [(i, 1) for i in range(len(requests))])
        if in_kernel:
            return self._sample_in_kernel(logits.contiguous(), params, uniforms), raw_logits, rewinds
        token_ids = logits.argmax(dim=-1)
        sampled_params = [params[i] for i in rows]
        temperature = torch.tensor([p.temperature for p in sampled_params], dtype=logits.dtype).unsqueeze(1)
        probs = torch.softmax(logits[rows] / temperature, dim=-1)
        token_ids[rows] = _draw(probs, sampled_params, uniforms[rows])
        return token_ids, raw_logits, rewinds

    def _sample_in_kernel(
        self, logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
    ) -> torch.Tensor:
        assert self.kernels is not None
        temperature = [0.0 if p.is_greedy else p.temperature for p in params]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        return self.kernels.sample_rows(logits, temperature, top_k, top_p, min_p, uniforms)

    def _uniforms(
        self, rows: Sequence[SampledSequence], spans: list[tuple[int, int]]
    ) -> tuple[torch.Tensor, list[tuple[int, torch.Generator, torch.Tensor]]]:
        """One uniform per row: a seeded request's rows from its own generator, in order, the rest in
        one draw from ours. Greedy rows' uniforms are never used, and seeded greedy requests draw none."""
        uniforms = torch.rand(len(rows), generator=self.generator)
        rewinds = []
        for i, (start, count) in enumerate(spans):
            first = rows[start]
            generator = first.generator
            if generator is None or first.sampling_params.is_greedy:
                continue
            if count > 1:
                rewinds.append((i, generator, generator.get_state()))
            uniforms[start : start + count] = torch.rand(count, generator=generator)
        return uniforms, rewinds


def _draw(probs: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws, one per row of probs [rows, vocab]: rows that truncate (top-k, top-p, min-p)
    draw among their top candidates, the rest over the whole vocabulary."""
    vocab = probs.shape[-1]
    token_ids = torch.empty(len(params), dtype=torch.long)
    truncated = [i for i, p in enumerate(params) if _truncates(p, vocab)]
    plain = [i for i, p in enumerate(params) if not _truncates(p, vocab)]
    if plain:
        token_ids[plain] = _inverse_cdf(probs[plain], uniforms[plain])
    if truncated:
        token_ids[truncated] = _draw_truncated(
            probs[truncated], [params[i] for i in truncated], uniforms[truncated]
        )
    return token_ids


def _truncates(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The index where each row's cumulative mass first exceeds its uniform times the row's total
    (rows need not be normalized; zero-mass entries are never chosen)."""
    cdf = probs.cumsum(dim=-1)
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _draw_truncated(
    probs: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
) -> torch.Tensor:
    """top-k, then top-p over the top-k renormalized mass, then min-p, as transformers and vLLM apply
    them. A full sort of the vocabulary costs more than the forward pass at batch 32, so each row
    looks at its top CANDIDATES tokens first, and only rows whose kept set may reach beyond them look
    again at four times as many."""
    vocab = probs.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype).unsqueeze(1)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).unsqueeze(1)
    token_ids = torch.empty(len(params), dtype=torch.long)
    pending = torch.arange(len(params))
    num_candidates = CANDIDATES
    while len(pending):
        limited = top_k[pending] < vocab
        width = min(vocab, max(num_candidates, int(top_k[pending].masked_fill(~limited, 0).max())))
        values, indices = probs[pending].topk(width, dim=-1)  # [rows, width], descending
        keep = torch.arange(width).unsqueeze(0) < top_k[pending].unsqueeze(1)
        values = values.masked_fill(~keep, 0.0)
        # the mass top-p is measured against: the top-k tokens', or everything's when top-k is off
        total = torch.where(limited, values.sum(dim=-1), 1.0).unsqueeze(1)
        cumulative = values.cumsum(dim=-1)
        keep &= (cumulative - values) < top_p[pending] * total
        keep &= values >= min_p[pending] * values[:, :1]
        keep[:, 0] = True
        # a row is done when no token past its candidates could have been kept
        done = limited | (width == vocab)
        done |= cumulative[:, -1] >= top_p[pending, 0] * total[:, 0]
        done |= values[:, -1] < min_p[pending, 0] * values[:, 0]
        rows = done.nonzero().squeeze(1)
        kept = values[rows].masked_fill(~keep[rows], 0.0)
        positions = _inverse_cdf(kept, uniforms[pending[rows]])
        token_ids[pending[rows]] = indices[rows].gather(1, positions.unsqueeze(1)).squeeze(1)
        pending = pending[~done]
        num_candidates *= 4
    return token_ids


def _has_penalty(p) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _apply_penalties(logits: torch.Tensor, requests: Sequence[SampledSequence]) -> torch.Tensor:
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


def _suppress_stops(logits: torch.Tensor, requests: Sequence[SampledSequence]) -> torch.Tensor:
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


def _logprobs(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[SampledSequence]
) -> list[TokenLogprobs | None]:
    """Per request: [(sampled, logprob), (top1, logprob), ...] of the model's raw distribution, or None."""
    wanted = {i: r.sampling_params.logprobs for i, r in enumerate(requests)}
    wanted = {i: n for i, n in wanted.items() if n is not None}
    if not wanted:
        return [None] * len(requests)
    rows = list(wanted)
    logprobs = torch.log_softmax(raw_logits[rows], dim=-1)
    # [rows, max_n]: the top entries of every row that asked, sliced per row below
    top_values, top_ids = logprobs.topk(max(wanted.values()), dim=-1)
    sampled = token_ids[rows]
    sampled_lp = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
    result: list[TokenLogprobs | None] = [None] * len(requests)
    for j, (i, n) in enumerate(wanted.items()):
        top = zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist(), strict=True)
        result[i] = [(int(sampled[j]), sampled_lp[j]), *top]
    return result
