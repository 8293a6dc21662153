"""Scheduler: continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step `schedule()` spends a token budget (`max_num_batched_tokens`): first on the running requests
in admission order (a decode takes 1 token, an unfinished prefill takes what is left of its prompt, up
to the budget), then on waiting requests in FCFS order while fewer than `max_num_seqs` run. When a
running request cannot get a KV block, the newest running request is preempted: its blocks are freed
and it goes back to the front of the waiting queue, to recompute prompt + output when it resumes.

With speculative decoding (`options.speculative`), a decoding request may also get draft tokens
(nanoserve.core.speculator): they take budget and KV slots like known tokens, and the runner verifies
them in the same forward pass.

`update_from_output()` then advances each scheduled request by its chunk (the known tokens and the
accepted drafts), appends the sampled tokens one at a time under the stop conditions, gives back the
slots of rejected drafts and frees finished requests.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from nanoserve.config import EngineOptions
from nanoserve.core.kv_cache import KVCacheManager
from nanoserve.core.request import Request, RequestStatus
from nanoserve.core.speculator import Speculator
from nanoserve.model.batch import RunnerOutput, ScheduledChunk, SchedulerOutput
from nanoserve.wire.messages import EngineCoreOutput, SchedulerStats

MAX_HELD_TOKENS = 16
"""A final-output-only request's first token travels at once (its time to first token stays true), the
others when it finishes or when this many are held back: an engine restarted after a crash resumes it at
most this many tokens back, at 1/16 of the messages."""


class Scheduler:
    def __init__(
        self,
        options: EngineOptions,
        num_kv_blocks: int,
        max_model_len: int,
        sliding_window: int | None = None,
    ) -> None:
        """sliding_window: the window every layer of the model attends within, if it has one."""
        if max_model_len > num_kv_blocks * options.block_size:
            # A lone request of max_model_len tokens must fit, or it would preempt itself forever.
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the KV cache capacity of "
                f"{num_kv_blocks} blocks x {options.block_size} tokens."
            )
        self.max_num_seqs = options.max_num_seqs
        self.max_num_batched_tokens = options.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.kv_cache = KVCacheManager(
            num_kv_blocks, options.block_size, options.enable_prefix_caching, sliding_window
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        """In admission order: the last one is the newest, the first to preempt."""
        self.num_preemptions = 0
        self.speculator = Speculator(options) if options.speculative == "ngram" else None

    # ---- queue -----------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"Request {request.request_id} has {request.num_prompt_tokens} prompt tokens, "
                f"more than max_model_len={self.max_model_len}."
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)
        request.queued_time = time.monotonic()

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def request_ids(self) -> list[str]:
        """Ids of every unfinished request, running or waiting."""
        return list(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- schedule --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        kv = self.kv_cache

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(
                request.num_tokens - request.num_computed_tokens,
                budget,
                self.max_model_len - request.num_computed_tokens,
            )
            if num_new <= 0:
                i += 1
                continue
            drafts = self._drafts(request, budget - num_new)
            if drafts and not kv.allocate_slots(request, num_new + len(drafts)):
                drafts = []  # no room to speculate: decode plainly, preempting only for that
            while not drafts and not kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            if request.status is RequestStatus.PREEMPTED:
                break  # it was the newest; nobody after it is left to schedule
            chunk = ScheduledChunk(request, num_new + len(drafts), kv.block_ids(request.request_id), drafts)
            out.chunks.append(chunk)
            budget -= chunk.num_new_tokens
            i += 1

        # Admitting new work in a step that had to preempt would only thrash the cache.
        awaiting_grammar: list[Request] = []
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and not out.preempted_request_ids
        ):
            request = self.waiting[0]
            if request.is_awaiting_grammar:  # its grammar compiles off-thread; the others go on
                awaiting_grammar.append(self.waiting.popleft())
                continue
            # prompt logprobs need every prompt position computed, so no prefix-cache hits
            num_cached = 0 if request.needs_prompt_logprobs else kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_cached, budget)
            if not kv.allocate_slots(request, num_new, num_cached):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
                request.scheduled_time = time.monotonic()
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, num_new, kv.block_ids(request.request_id)))
            budget -= num_new
        self.waiting.extendleft(reversed(awaiting_grammar))
        out.block_copies = kv.take_block_copies()
        return out

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request, leaving room for the token sampled after them within
        max_tokens and max_model_len."""
        if self.speculator is None or request.num_tokens - request.num_computed_tokens != 1:
            return []
        room = min(
            budget,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        return self.speculator.propose(request, len(self.running), max(room, 0))

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- update ----------------------------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput, out: RunnerOutput) -> list[EngineCoreOutput]:
        index = {request_id: j for j, request_id in enumerate(out.request_ids)}
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        for chunk in sched.chunks:
            request = self.requests.get(chunk.request.request_id)
            if request is None:
                continue  # aborted while the step ran
            samples = chunk.samples  # read before advancing: it compares against num_computed_tokens
            j = index.get(request.request_id) if samples else None
            if j is None:
                request.num_computed_tokens += chunk.num_new_tokens
                self.kv_cache.cache_computed_blocks(request)
                request.prompt_logprobs.extend(out.prompt_logprobs.get(request.request_id, ()))
                continue
            sampled = out.sampled_token_ids[j]
            num_accepted = len(sampled) - 1
            if chunk.draft_token_ids and self.speculator is not None:
                self.speculator.record(request.request_id, len(chunk.draft_token_ids), num_accepted)
            request.prompt_logprobs.extend(out.prompt_logprobs.get(request.request_id, ()))
            tokens, status, error = self._append_tokens(request, sampled)
            # K/V are in the cache for the known tokens and the accepted drafts, of the tokens kept
            computed = request.num_computed_tokens + chunk.num_known_tokens + num_accepted
            request.num_computed_tokens = min(computed, request.num_tokens)
            self.kv_cache.cache_computed_blocks(request)
            if status is not None:
                request.status = status
                self._free(request)
                any_finished = True
            elif chunk.draft_token_ids:
                self.kv_cache.trim(request, request.num_tokens)
            entries = out.logprobs[j] if j < len(out.logprobs) else None
            logprobs = None if entries is None else entries[: len(tokens)]
            if (
                request.final_output_only
                and status is None
                and request.num_sent_tokens
                and request.num_output_tokens - request.num_sent_tokens < MAX_HELD_TOKENS
            ):
                request.held_logprobs.extend(logprobs or ())
                continue
            is_first = request.num_sent_tokens == 0
            tokens, logprobs = request.take_unsent(logprobs)
            outputs.append(
                EngineCoreOutput(
                    request.request_id,
                    tokens,
                    new_logprobs=logprobs,
                    finish_reason=None if status is None else status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    queued_time=request.queued_time if is_first else 0.0,
                    scheduled_time=request.scheduled_time if is_first else 0.0,
                    error=error,
                    prompt_logprobs=request.prompt_logprobs
                    if is_first and request.sampling_params.prompt_logprobs is not None
                    else None,
                )
            )
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _append_tokens(
        self, request: Request, tokens: list[int]
    ) -> tuple[list[int], RequestStatus | None, str | None]:
        """Append sampled tokens one by one, as plain decoding would, up to the first that finishes the
        request; returns the tokens kept, the finishing status and the error, if any."""
        for i, token in enumerate(tokens):
            request.append_output_token(token)
            if request.grammar is not None and not request.grammar.accept(token):
                error = f"The sampled token {token} breaks the structured output: {request.grammar.error}"
                return tokens[: i + 1], RequestStatus.FINISHED_ERROR, error
            status = self._check_stop(request, token)
            if status is not None:
                return tokens[: i + 1], status, None
        return tokens, None, None

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.grammar is not None and request.grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.min_tokens:
            if token in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _free(self, request: Request) -> None:
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        if self.speculator is not None:
            self.speculator.forget(request.request_id)

    # ---- finish from outside ---------------------------------------------------------------------

    def finish_requests(
        self, request_ids: str | Iterable[str], status: RequestStatus, error: str | None = None
    ) -> list[EngineCoreOutput]:
        """Finish requests from outside the step (abort, error: why); unknown ids are ignored."""
        assert status.is_finished, status
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        outputs: list[EngineCoreOutput] = []
        finished: set[str] = set()
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                finished.add(request_id)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            tokens, logprobs = request.take_unsent(None)
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    tokens,
                    new_logprobs=logprobs,
                    finish_reason=status.finish_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    error=error,
                )
            )
        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
        return outputs

    # ---- stats -----------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache.usage,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_draft_tokens=self.speculator.num_draft_tokens if self.speculator else 0,
            num_accepted_tokens=self.speculator.num_accepted_tokens if self.speculator else 0,
        )
