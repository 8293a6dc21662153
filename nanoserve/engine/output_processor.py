"""OutputProcessor: `EngineCoreOutputs` -> `RequestOutput`s, one engine step at a time.

It owns the frontend's per-request state: incremental detokenization, stop strings, logprobs, and the
gathering of an n > 1 request's n engine requests ("{i}_{request_id}") into one `RequestOutput`.
A stop string is found here, not in the engine, so `process_outputs` also returns the engine request
ids the caller must abort. Outputs for ids no longer tracked (finished or aborted) are ignored.
"""

from __future__ import annotations

import msgspec

from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from nanoserve.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason


def fan_out(request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """Split an n > 1 request into n engine requests "{i}_{id}" with n=1 (and seed + i when seeded)."""
    params = request.sampling_params
    if params.n == 1:
        return [request]
    children = []
    for i in range(params.n):
        seed = None if params.seed is None else params.seed + i
        child_params = msgspec.structs.replace(params, n=1, seed=seed)
        children.append(
            msgspec.structs.replace(
                request, request_id=f"{i}_{request.request_id}", sampling_params=child_params
            )
        )
    return children


def logprob_dict(tokenizer, entries: list[tuple[int, float]]) -> dict[int, Logprob]:
    """[(chosen_id, logprob), (top1_id, logprob), ...] -> {token_id: Logprob}, ranks from 1."""
    (chosen_id, chosen_lp), top = entries[0], entries[1:]
    step = {tid: Logprob(lp, rank, tokenizer.decode([tid])) for rank, (tid, lp) in enumerate(top, start=1)}
    if chosen_id not in step:
        rank = 1 + sum(lp > chosen_lp for _, lp in top)
        step[chosen_id] = Logprob(chosen_lp, rank, tokenizer.decode([chosen_id]))
    return step


class SampleState:
    """One engine request: the frontend's view of one sample of a user request."""

    def __init__(self, tokenizer, request: EngineCoreRequest, index: int) -> None:
        params = request.sampling_params
        self.tokenizer = tokenizer
        self.index = index
        self.detokenizer = IncrementalDetokenizer(tokenizer, params, request.prompt_token_ids)
        self.num_logprobs = params.logprobs
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: EngineCoreOutput) -> bool:
        """Apply one engine output; return True when a stop string finished the sample here."""
        num_consumed, stop = self.detokenizer.update(output.new_token_ids)
        if output.new_logprobs is not None and self.logprobs is not None:
            for entries in output.new_logprobs[:num_consumed]:
                self.logprobs.append(logprob_dict(self.tokenizer, entries))
                self.cumulative_logprob = (self.cumulative_logprob or 0.0) + entries[0][1]
        if stop is not None:
            self.finish_reason, self.stop_reason = str(FinishReason.STOP), stop
            return True
        if output.finish_reason is not None:
            self.finish_reason, self.stop_reason = str(output.finish_reason), output.stop_reason
            self.error = output.error
        return False

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.visible_text(self.finished),
            token_ids=list(self.detokenizer.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
        )


class RequestState:
    """One user request and its n samples."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.samples: dict[str, SampleState] = {}
        """Engine request id -> sample."""
        self.num_cached_tokens = 0
        self.prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples.values())

    def make_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion() for s in self.samples.values()],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
        )


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        """User request id -> state."""
        self.engine_to_request: dict[str, RequestState] = {}
        """Engine request id -> the user request it is a sample of."""

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def add_request(self, request: EngineCoreRequest, prompt: str | None = None) -> list[EngineCoreRequest]:
        """Track a request; return the engine requests to send for it (n of them when n > 1)."""
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already running.")
        state = RequestState(request.request_id, prompt, request.prompt_token_ids)
        engine_requests = fan_out(request)
        for index, engine_request in enumerate(engine_requests):
            state.samples[engine_request.request_id] = SampleState(self.tokenizer, engine_request, index)
            self.engine_to_request[engine_request.request_id] = state
        self.requests[request.request_id] = state
        return engine_requests

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Stop tracking user requests; return the engine request ids still running for them."""
        engine_ids: list[str] = []
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            for engine_id, sample in state.samples.items():
                self.engine_to_request.pop(engine_id, None)
                if not sample.finished:
                    engine_ids.append(engine_id)
        return engine_ids

    def process_outputs(self, engine_outputs: EngineCoreOutputs) -> tuple[list[RequestOutput], list[str]]:
        """Return (outputs of the user requests touched this step, engine ids to abort in the engine)."""
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for output in engine_outputs.outputs:
            state = self.engine_to_request.get(output.request_id)
            if state is None:
                continue
            sample = state.samples[output.request_id]
            if sample.finished:
                continue
            if sample.update(output) and not output.finished:
                to_abort.append(output.request_id)
            if sample.finished:
                del self.engine_to_request[output.request_id]
            state.num_cached_tokens = max(state.num_cached_tokens, output.num_cached_tokens)
            if output.prompt_logprobs is not None and state.prompt_logprobs is None:
                steps = [logprob_dict(self.tokenizer, entries) for entries in output.prompt_logprobs]
                state.prompt_logprobs = [None, *steps]
            touched[state.request_id] = state
        request_outputs = []
        for state in touched.values():
            request_outputs.append(state.make_output())
            if state.finished:
                del self.requests[state.request_id]
        return request_outputs, to_abort
