"""The runner's input contract: what the scheduler hands the model runner each step, and what comes back.

It lives in model/ so that the runner and the sampler read requests through `SequenceState` (a
Protocol the engine core's Request satisfies) without importing core/: core imports model, never the
other way round.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from nanoserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from nanoserve.structured_output.matcher import GrammarMatcher


class SampledSequence(Protocol):
    """What the sampler reads of the sequence it samples the next token of."""

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens."""
        ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def generator(self) -> torch.Generator | None:
        """The request's own random generator when it has a seed."""
        ...

    @property
    def grammar(self) -> GrammarMatcher | None:
        """Its structured-output matcher, once compiled."""
        ...


class SequenceState(SampledSequence, Protocol):
    """What the runner and the sampler read of one request."""

    request_id: str
    num_computed_tokens: int
    """Tokens whose K/V are in the cache."""
    prompt_logprobs: list[list[tuple[int, float]]]
    """Prompt logprobs computed so far, when the request asked for them."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def needs_prompt_logprobs(self) -> bool: ...


NULL_BLOCK = -1
"""A block-table entry whose block was freed (out of every layer's sliding window): never read."""


TokenLogprobs = list[tuple[int, float]]
"""One generated token's [(its id, logprob), (top1 id, logprob), ...]."""


@dataclass
class ScheduledChunk:
    """`num_new_tokens` tokens of one request, starting at `request.num_computed_tokens`: its known
    tokens, then (speculative decoding) the draft tokens, which the forward pass verifies."""

    request: SequenceState
    num_new_tokens: int
    block_ids: list[int]
    """The request's whole block table (shared with the KV cache manager; read-only here). Blocks that
    fell out of a sliding window are NULL_BLOCK."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Guesses at the tokens after the known ones (counted in num_new_tokens); only on a decode."""

    @property
    def num_known_tokens(self) -> int:
        return self.num_new_tokens - len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so new tokens are sampled: one per
        draft token and one more, of which the sampler keeps those up to the first mismatched draft."""
        return self.request.num_computed_tokens + self.num_known_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    """Decodes first, then prefills, in the order the runner lays out the batch."""
    preempted_request_ids: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(source, destination) KV blocks to copy, in order, before the forward pass (prefix-cache partial
    hits: KVCacheManager)."""
    grammar_bitmask: Future[torch.Tensor] | None = None
    """Being filled while the model runs: for each sampling chunk with a grammar, in chunk order, one row
    per sampled position (1 + its draft tokens), each as the grammar stands after the drafts before it."""

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
    sampled_token_ids: list[list[int]]
    """Per request: the accepted draft tokens, then the token sampled after them (at least one token)."""
    logprobs: list[list[TokenLogprobs] | None]
    """Per request: one entry per sampled token, or None when not requested."""
    prompt_logprobs: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)
    """Request id -> the prompt logprobs this step computed, continuing `SequenceState.prompt_logprobs`."""
