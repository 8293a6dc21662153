"""Request: the engine core's state for one request, from admission to finish."""

from __future__ import annotations

import enum

import torch

from nanoserve.sampling_params import SamplingParams
from nanoserve.structured_output.matcher import GrammarMatcher
from nanoserve.wire.messages import EngineCoreRequest, FinishReason


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """Token ids, progress and sampling state of one sequence.

    `num_computed_tokens` counts tokens whose K/V are in the cache; the request samples a new token
    in a step that brings it to `num_tokens`. After preemption it drops to 0 and the whole sequence
    (prompt + output so far) is recomputed as a prefill.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        arrival_time: float,
        max_tokens: int,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        """Tokens that end the sequence (unless sampling_params.ignore_eos): the model may declare several."""
        self.arrival_time = arrival_time
        self.max_tokens = max_tokens
        """sampling_params.max_tokens, resolved against max_model_len by the engine."""
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache at first scheduling."""
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.queued_time = 0.0
        self.scheduled_time = 0.0
        """time.monotonic() when the scheduler queued the request and when it first scheduled it."""
        self.block_hashes: list[int] = []
        """Chained hashes of this request's full blocks, maintained by the KV cache manager."""
        self.prompt_logprobs: list[list[tuple[int, float]]] = []
        """Per prompt token from the second on: [(its id, logprob), (top1 id, logprob), ...], as the
        prefill computes them; sent with the first sampled token."""
        self.final_output_only = False
        """Hold output tokens back (EngineCoreRequest.final_output_only)."""
        self.num_sent_tokens = 0
        """Output tokens the frontend has (a resumed request's included)."""
        self.held_logprobs: list[list[tuple[int, float]]] = []
        """The logprobs of output tokens held back, when asked for."""
        self.grammar: GrammarMatcher | None = None
        """The structured-output matcher, attached once its grammar is compiled."""
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling_params.seed)

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest, max_tokens: int) -> Request:
        """The engine's request for a wire request. A resumed request (replayed after an engine restart)
        starts with its delivered tokens as output already produced, and the state that follows from
        output tokens is brought to that point: here the seeded generator, which has drawn once per
        sampled token (greedy rows draw nothing); the structured-output matcher is built past them when
        the engine admits the request (`EngineCore.add_request`)."""
        engine_request = cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            tuple(request.eos_token_ids),
            request.arrival_time,
            max_tokens,
        )
        engine_request.final_output_only = request.final_output_only
        resumed = request.resumed_output_token_ids
        if resumed:
            engine_request.num_sent_tokens = len(resumed)
            engine_request.output_token_ids = list(resumed)
            engine_request.all_token_ids.extend(resumed)
            if engine_request.generator is not None and not request.sampling_params.is_greedy:
                torch.rand(len(resumed), generator=engine_request.generator)
        return engine_request

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_awaiting_grammar(self) -> bool:
        return self.sampling_params.structured_outputs is not None and self.grammar is None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while some prompt token's logprobs are still to be computed."""
        wanted = self.sampling_params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def take_unsent(
        self, step_logprobs: list[list[tuple[int, float]]] | None
    ) -> tuple[list[int], list[list[tuple[int, float]]] | None]:
        """The output tokens the frontend does not have yet, now counted as sent, with their logprobs: those
        held back and step_logprobs, this step's (None, with none held: not asked for)."""
        tokens = self.output_token_ids[self.num_sent_tokens :]
        self.num_sent_tokens = self.num_output_tokens
        if not self.held_logprobs:
            return tokens, step_logprobs
        logprobs, self.held_logprobs = self.held_logprobs + list(step_logprobs or ()), []
        return tokens, logprobs

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
