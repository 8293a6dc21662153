"""What the scheduler hands the model runner each step, and what the runner hands back."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from nanoserve.core.request import Request


@dataclass
class ScheduledChunk:
    """`num_new_tokens` tokens of one request, starting at `request.num_computed_tokens`."""

    request: Request
    num_new_tokens: int
    block_ids: list[int]
    """The request's whole block table (shared with the KV cache manager; read-only here)."""

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a new token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    """Decodes first, then prefills, in the order the runner lays out the batch."""
    preempted_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Future[torch.Tensor] | None = None
    """Being filled while the model runs: one row per sampling chunk with a grammar, in chunk order."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class RunnerOutput:
    """One entry per sampling chunk of the SchedulerOutput, in the same order."""

    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[list[tuple[int, float]] | None]
    """Per sampled token: [(sampled_id, logprob), (top_id, logprob)...], or None when not requested."""
    prompt_logprobs: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)
    """Request id -> the prompt logprobs this step computed, continuing `Request.prompt_logprobs`."""
