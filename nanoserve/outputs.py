"""What the frontends hand back to users: `RequestOutput` holding one `CompletionOutput` per sample.

Field names follow vLLM's so that code written against it reads the same here. Text and token ids are
cumulative: each output of a request carries everything generated so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    """1 = most likely token. For a sampled token outside the returned top-k it is a lower bound (k + 1)."""
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated token: {token_id: Logprob} for the sampled token and the requested top-k."""

PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt token: {token_id: Logprob} for that token and the requested top-k; None for the first."""


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    """Sum of the sampled tokens' logprobs; None unless logprobs were requested."""
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    """"stop", "length", "abort" or "error"; None while the sample is still generating."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the sample, when one did."""
    error: str | None = None
    """Why the engine refused or failed this sample (finish_reason is then "error")."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    prompt_logprobs: PromptLogprobs | None = None
    """When SamplingParams.prompt_logprobs was set (from the first output on)."""

    @property
    def error(self) -> str | None:
        return next((o.error for o in self.outputs if o.error is not None), None)
