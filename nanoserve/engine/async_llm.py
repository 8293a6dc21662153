"""AsyncLLM: the asyncio frontend engine, over `AsyncMPClient` (the engine core runs in a child process).

`async for out in engine.generate(prompt, params, request_id)` streams a request's outputs as its
tokens arrive. One output-handler task pulls `EngineCoreOutputs` from the client, runs them through the
OutputProcessor in small slices (yielding to the loop between slices, so a big batch never stalls it)
and routes each `RequestOutput` to its request's stream. A consumer that stops early (cancelled,
`aclose()`, a client that went away) aborts its request in the engine, freeing its KV blocks.

Whether the engine lives is the client's `liveness`, read here, never copied. With `engine_restarts`
a dead engine core comes back and its requests resume: the streams see a pause, then the rest. When
the engine is dead for good the handler pushes the `EngineDeadError` into every open stream, `errored`
turns true, and every later call raises that error. When one data-parallel rank dies while others
live, only the requests it held get its `EngineDeadError`; `dead_ranks` names the dead ranks (/health
reports them). Prompts are tokenized on one worker thread, so a long prompt never blocks the event
loop (one thread: the Rust tokenizer is not shared between threads).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.base import EngineCoreClient
from nanoserve.engine.core_client.liveness import RankState
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.engine.output_processor import OutputProcessor
from nanoserve.engine.processor import Conversation, Processor, PromptType
from nanoserve.engine.startup import start_engine
from nanoserve.model_files import model_name, resolve_model_path
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineDeathRecord, SchedulerStats

logger = logging.getLogger(__name__)

OUTPUT_SLICE_SIZE = 64
"""Engine outputs processed between two yields to the event loop."""


class EngineHungError(EngineDeadError):
    """The engine core process is alive but has produced no output for too long while it had work."""


@dataclass
class FinishedRequestStats:
    request_id: str
    finish_reason: str
    e2e_latency: float
    time_to_first_token: float | None
    """None when the request ended before its first token."""
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time: float | None = None
    """Queued -> first scheduled; this and the phases below are None for a request that got no token."""
    prefill_time: float | None = None
    """First scheduled -> first token."""
    decode_time: float | None = None
    """First token -> last token."""
    inference_time: float | None = None
    """First scheduled -> last token."""


@dataclass
class IterationStats:
    """What one batch of engine outputs did, for metrics."""

    engine_index: int = 0
    """The data-parallel rank that sent the batch (and the scheduler stats that come with it)."""
    num_prompt_tokens: int = 0
    """Prompt tokens of the requests that produced their first token in this batch."""
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


StatLogger = Callable[[SchedulerStats | None, IterationStats], None]
"""Called on the event loop after each batch of engine outputs (and when requests are aborted)."""


@dataclass
class _RequestTiming:
    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    # the engine's clock (its outputs' timestamps), which the frontend's need not share
    queued_time: float | None = None
    scheduled_time: float | None = None
    first_token_engine_time: float | None = None
    last_token_engine_time: float | None = None

    def add_tokens(self, output: EngineCoreOutput, now: float, engine_now: float) -> None:
        if output.scheduled_time:  # the first token of a sample; with n > 1 the earliest sample counts
            self.queued_time = min(self.queued_time or output.queued_time, output.queued_time)
            self.scheduled_time = min(self.scheduled_time or output.scheduled_time, output.scheduled_time)
        if self.first_token_engine_time is None:
            self.first_token_engine_time = engine_now
        self.last_token_engine_time = engine_now
        self.first_token_time = self.first_token_time or now
        self.last_token_time = now
        self.num_generation_tokens += len(output.new_token_ids)

    def finished(self, request_id: str, finish_reason: str, now: float) -> FinishedRequestStats:
        ttft = self.first_token_time - self.arrival_time if self.first_token_time is not None else None
        stats = FinishedRequestStats(
            request_id,
            finish_reason,
            now - self.arrival_time,
            ttft,
            self.num_prompt_tokens,
            self.num_generation_tokens,
        )
        first, last = self.first_token_engine_time, self.last_token_engine_time
        if self.queued_time is not None and self.scheduled_time is not None and first and last:
            stats.queue_time = self.scheduled_time - self.queued_time
            stats.prefill_time = first - self.scheduled_time
            stats.decode_time = last - first
            stats.inference_time = last - self.scheduled_time
        return stats


class RequestStream:
    """The outputs of one request on their way to its consumer; cumulative, so a slow consumer may skip
    intermediate ones and lose nothing."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def get(self) -> RequestOutput:
        """The newest output (skipping older queued ones); raises the error pushed into the stream."""
        item = await self._queue.get()
        while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            raise item
        self.finished = item.finished
        return item


class AsyncLLM:
    """`AsyncLLM(model=None, **engine_options)`; the same option names as `LLM`."""

    engine_core: EngineCoreClient

    def __init__(
        self, model: str | None = None, *, stat_loggers: list[StatLogger] | None = None, **options: Any
    ) -> None:
        self._build(EngineOptions.from_kwargs(model, **options), stat_loggers or [])

    @classmethod
    def from_options(cls, options: EngineOptions, stat_loggers: list[StatLogger] | None = None) -> AsyncLLM:
        engine = cls.__new__(cls)
        engine._build(options, stat_loggers or [])
        return engine

    def _build(self, options: EngineOptions, stat_loggers: list[StatLogger]) -> None:
        self._output_handler: asyncio.Task | None = None
        self._is_shut_down = False
        options = dataclasses.replace(options, multiprocess_mode=True)
        self.options = options
        self.model_path = resolve_model_path(options.model)
        self.model_name = model_name(self.model_path)
        self.stat_loggers = list(stat_loggers)
        self.engine_core, files = start_engine(
            self.model_path, lambda: EngineCoreClient.make_client(True, True, options)
        )
        self.tokenizer = files.tokenizer
        self.generation_defaults = files.generation_defaults
        """SamplingParams fields the model's generation config sets, for requests that leave them out."""
        ready = self.engine_core.ready_response
        self.max_model_len = ready.max_model_len
        self.max_num_seqs = ready.max_num_seqs
        """Sequences the engine runs at once (summed over data-parallel ranks); more wait in its queue."""
        self.processor = Processor.for_engine(self.tokenizer, ready, files.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.streams: dict[str, RequestStream] = {}
        self._timings: dict[str, _RequestTiming] = {}
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="nanoserve-tokenize"
        )
        self._request_counter = itertools.count()
        self.last_output_time = time.monotonic()
        """When the engine last produced an output, or when it last went from idle to busy."""
        self.last_scheduler_stats: SchedulerStats | None = None
        try:  # on a running loop the handler starts now, so death is noticed even while idle
            asyncio.get_running_loop()
            self.start()
        except RuntimeError:
            pass

    # -- state --------------------------------------------------------------------------------

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine is dead for good, or None while it lives (or comes back)."""
        return self.engine_core.liveness.dead_error

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def restarting_ranks(self) -> list[int]:
        """Engine ranks on their way back after a death (within their restart budget)."""
        return self.engine_core.liveness.ranks_in(RankState.RESTARTING)

    @property
    def engine_restarts(self) -> dict[int, int]:
        """Restarts so far, by engine rank."""
        return self.engine_core.liveness.restart_counts()

    @property
    def dead_ranks(self) -> dict[int, EngineDeadError]:
        """Data parallel: ranks that died while others still serve, with why."""
        return self.engine_core.dead_rank_errors()

    @property
    def is_running(self) -> bool:
        return self._output_handler is not None and not self._output_handler.done()

    @property
    def num_unfinished_seqs(self) -> int:
        """Engine requests in flight (a request with n samples counts n), running or waiting."""
        return len(self.output_processor.engine_to_request)

    def _silent_since(self) -> float:
        """The hang clock's start: the last output, becoming busy, or an engine's return from a restart."""
        return max(self.last_output_time, self.engine_core.liveness.revived_at)

    def is_hung(self, timeout_s: float) -> bool:
        """True when requests are in flight but the engine has said nothing for `timeout_s` seconds
        (a restart in progress is not a hang)."""
        if not self.streams or self.restarting_ranks:
            return False
        return time.monotonic() - self._silent_since() > timeout_s

    async def check_health(self, hang_timeout_s: float | None = None) -> None:
        """Raise EngineDeadError when the engine is dead (or EngineHungError when it looks hung)."""
        if self.dead_error is not None:
            raise self.dead_error
        if hang_timeout_s is not None and self.is_hung(hang_timeout_s):
            raise EngineHungError(
                f"The engine core has produced no output for {time.monotonic() - self._silent_since():.1f} s "
                f"with {len(self.streams)} request(s) in flight."
            )

    async def wait_for_death(self) -> None:
        """Return once the output handler has ended: the engine is dead for good (see `errored`), or
        this AsyncLLM was shut down. A restart is not an end."""
        self.start()
        if self._output_handler is not None:
            await asyncio.wait({self._output_handler})

    def start(self) -> None:
        """Start the output handler on the running loop (done by the first request if not before)."""
        if self._output_handler is None and not self._is_shut_down:
            self._output_handler = asyncio.get_running_loop().create_task(
                self._run_output_handler(), name="AsyncLLMOutputHandler"
            )

    # -- requests -----------------------------------------------------------------------------

    async def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> dict[str, Any]:
        """{"prompt": text or None, "prompt_token_ids": [...]}, tokenized off the event loop."""
        if isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt):
            text, ids = await self._in_pool(self.processor.tokenize, prompt, add_special_tokens)
        else:
            text, ids = self.processor.tokenize(prompt)
        return {"prompt": text, "prompt_token_ids": ids}

    async def render_chat(
        self, conversation: Conversation, add_generation_prompt: bool = True, **options: Any
    ) -> dict[str, Any]:
        """The conversation through the chat template, tokenized off the event loop; options are
        `Processor.render_chat`'s (tools, chat_template, continue_final_message, add_special_tokens)."""
        render = functools.partial(self.processor.render_chat, **options)
        return await self._in_pool(render, conversation, add_generation_prompt)

    async def detokenize(self, token_ids: list[int]) -> str:
        """Token ids -> text, off the event loop; ValueError for ids outside the vocabulary."""
        return await self._in_pool(self.processor.detokenize, token_ids)

    async def _in_pool(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        final_output_only: bool = False,
    ) -> RequestStream:
        """Validate and send a request; return its stream. ValueError (nothing sent) when it is invalid.
        final_output_only: the caller reads only the finished output, so (without stop strings) the engine
        sends the first token and then chunks of tokens, not every step (EngineCoreRequest.final_output_only)."""
        self._ensure_alive()
        self.start()
        if request_id in self.streams:
            raise ValueError(f"Request id {request_id!r} is already running.")
        if isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt):
            prompt = await self.tokenize(prompt)
            self._ensure_alive()
        text, request = self.processor.process(
            request_id, prompt, params or SamplingParams(), final_output_only
        )
        if request_id in self.streams:
            raise ValueError(f"Request id {request_id!r} is already running.")
        stream = RequestStream(request_id)
        if not self.streams:
            self.last_output_time = time.monotonic()  # idle -> busy: the hang clock starts now
        engine_requests = self.output_processor.add_request(request, text)
        self.streams[request_id] = stream
        self._timings[request_id] = _RequestTiming(time.monotonic(), len(request.prompt_token_ids))
        try:
            await self.engine_core.add_requests_async(engine_requests)
        except BaseException:
            await self.abort(request_id)
            raise
        return stream

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        output_kind: str = "cumulative",
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs as tokens arrive; the last one has `finished` set.

        output_kind "cumulative": text and token ids so far; "delta": only what is new since the last
        yield. Stopping the iteration early (break, cancel, aclose) aborts the request in the engine.
        """
        if output_kind not in ("cumulative", "delta"):
            raise ValueError(f"output_kind must be 'cumulative' or 'delta', got {output_kind!r}.")
        if request_id is None:
            request_id = f"gen-{next(self._request_counter)}"
        stream = await self.add_request(request_id, prompt, sampling_params)
        async for output in self.iterate(stream, output_kind):
            yield output

    async def iterate(
        self, stream: RequestStream, output_kind: str = "cumulative"
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield a stream's outputs (see `generate`); aborts the request if left before it finishes."""
        sent: dict[int, tuple[int, int, int]] = {}  # index -> (chars, tokens, logprobs) already yielded
        try:
            while True:
                output = await stream.get()
                yield _delta(output, sent) if output_kind == "delta" else output
                if output.finished:
                    return
        finally:
            if not stream.finished:
                await self.abort(stream.request_id)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their streams end with no more outputs."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await self._abort_in_engine(self._forget(request_ids, "abort"))

    def _forget(self, request_ids: list[str], finish_reason: str) -> list[str]:
        """Stop tracking requests (counted as finished for that reason); returns the engine request ids
        still running for them."""
        engine_ids = self.output_processor.abort_requests(request_ids)
        stats = IterationStats()
        now = time.monotonic()
        for rid in request_ids:
            self.streams.pop(rid, None)
            timing = self._timings.pop(rid, None)
            if timing is not None:
                stats.finished.append(timing.finished(rid, finish_reason, now))
        self._log_stats(None, stats)
        return engine_ids

    async def _abort_in_engine(self, engine_ids: list[str]) -> None:
        if engine_ids and self.dead_error is None:
            try:
                await self.engine_core.abort_requests_async(engine_ids)
            except EngineDeadError:
                pass  # the engine is gone, and its requests with it

    # -- sleep mode -----------------------------------------------------------------------------

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free the KV cache and offload (level 1) or drop (level 2) the weights; see EngineCore.sleep."""
        await self._live_client().sleep_async(level, mode)

    async def wake_up(self) -> None:
        await self._live_client().wake_up_async()

    async def is_sleeping(self) -> bool:
        return await self._live_client().is_sleeping_async()

    def _live_client(self) -> EngineCoreClient:
        self._ensure_alive()
        assert self.engine_core is not None, "a live AsyncLLM has its client"
        return self.engine_core

    # -- the output handler ---------------------------------------------------------------------

    async def _run_output_handler(self) -> None:
        try:
            while True:
                engine_outputs = await self.engine_core.get_output_async()
                self.last_output_time = time.monotonic()
                if engine_outputs.death is not None:
                    await self._fail_dead_rank(engine_outputs, engine_outputs.death)
                    continue
                self.last_scheduler_stats = engine_outputs.scheduler_stats or self.last_scheduler_stats
                outputs = engine_outputs.outputs
                for start in range(0, max(len(outputs), 1), OUTPUT_SLICE_SIZE):
                    if start:
                        await asyncio.sleep(0)
                    part = _slice_outputs(engine_outputs, outputs[start : start + OUTPUT_SLICE_SIZE])
                    await self._process_slice(part, last=start + OUTPUT_SLICE_SIZE >= len(outputs))
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._fail_all(e)
        except Exception as e:
            logger.exception("AsyncLLM output handler failed")
            error = EngineDeadError(f"The output handler failed: {type(e).__name__}: {e}")
            error.__cause__ = e
            self.engine_core.liveness.end(error)  # nothing reads the engines' outputs any more
            self._fail_all(error)

    async def _process_slice(self, engine_outputs: EngineCoreOutputs, last: bool) -> None:
        stats = IterationStats(engine_index=engine_outputs.engine_index)
        now = time.monotonic()
        for output in engine_outputs.outputs:
            state = self.output_processor.engine_to_request.get(output.request_id)
            timing = self._timings.get(state.request_id) if state is not None else None
            if timing is None or not output.new_token_ids:
                continue
            num_new = len(output.new_token_ids)
            if timing.first_token_time is None:
                stats.time_to_first_tokens.append(now - timing.arrival_time)
                stats.num_prompt_tokens += timing.num_prompt_tokens
            elif timing.last_token_time is not None:
                stats.inter_token_latencies.extend([(now - timing.last_token_time) / num_new] * num_new)
            timing.add_tokens(output, now, engine_outputs.timestamp)
            stats.num_generation_tokens += num_new
        request_outputs, to_abort = self.output_processor.process_outputs(engine_outputs)
        for request_output in request_outputs:
            stream = self.streams.get(request_output.request_id)
            if stream is not None:
                stream.put(request_output)
            if request_output.finished:
                self.streams.pop(request_output.request_id, None)
                timing = self._timings.pop(request_output.request_id, None)
                if timing is not None:
                    reason = _finish_reason(request_output.outputs)
                    stats.finished.append(timing.finished(request_output.request_id, reason, now))
        if to_abort:
            await self.engine_core.abort_requests_async(to_abort)
        self._log_stats(engine_outputs.scheduler_stats if last else None, stats)

    async def _fail_dead_rank(self, engine_outputs: EngineCoreOutputs, death: EngineDeathRecord) -> None:
        """A data-parallel rank died holding these requests: each one's consumer gets the rank's
        `EngineDeadError`, as with a whole engine's death, while the other ranks serve on. Samples of the
        same requests (n > 1) on live ranks are aborted there."""
        error = self.engine_core.dead_rank_errors().get(death.engine_rank) or EngineDeadError(
            death.message, engine_rank=death.engine_rank
        )
        request_ids = []
        for output in engine_outputs.outputs:
            state = self.output_processor.engine_to_request.get(output.request_id)
            if state is not None and state.request_id not in request_ids:
                request_ids.append(state.request_id)
                stream = self.streams.get(state.request_id)
                if stream is not None:
                    stream.put(error)
        await self._abort_in_engine(self._forget(request_ids, "error"))

    def _log_stats(self, scheduler_stats: SchedulerStats | None, stats: IterationStats) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger(scheduler_stats, stats)
            except Exception:
                logger.exception("stat logger failed")

    def _fail_all(self, error: EngineDeadError) -> None:
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream.put(error)

    def _ensure_alive(self) -> None:
        if self._is_shut_down and self.dead_error is None:
            raise EngineDeadError("AsyncLLM has been shut down.")
        if self.dead_error is not None:
            raise self.dead_error

    # -- lifecycle ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the handler and the engine, fail open streams; idempotent."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        if self._output_handler is not None and not self._output_handler.done():
            self._output_handler.cancel()
        self.engine_core.shutdown()
        if self.streams:
            streams, self.streams = self.streams, {}
            for stream in streams.values():
                stream.put(EngineDeadError("AsyncLLM has been shut down."))
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    def get_tokenizer(self):
        return self.tokenizer


def _slice_outputs(engine_outputs: EngineCoreOutputs, outputs: list) -> EngineCoreOutputs:
    if len(outputs) == len(engine_outputs.outputs):
        return engine_outputs
    return EngineCoreOutputs(
        engine_index=engine_outputs.engine_index,
        outputs=outputs,
        scheduler_stats=engine_outputs.scheduler_stats,
        timestamp=engine_outputs.timestamp,
    )


def _finish_reason(outputs: list[CompletionOutput]) -> str:
    reasons = [o.finish_reason for o in outputs if o.finish_reason is not None]
    for reason in ("error", "abort", "length"):
        if reason in reasons:
            return reason
    return reasons[0] if reasons else "abort"


def _delta(output: RequestOutput, sent: dict[int, tuple[int, int, int]]) -> RequestOutput:
    """The part of a cumulative output not yet yielded; updates `sent`."""
    completions = []
    for c in output.outputs:
        num_chars, num_tokens, num_logprobs = sent.get(c.index, (0, 0, 0))
        logprobs = c.logprobs[num_logprobs:] if c.logprobs is not None else None
        completions.append(
            dataclasses.replace(
                c, text=c.text[num_chars:], token_ids=c.token_ids[num_tokens:], logprobs=logprobs
            )
        )
        sent[c.index] = (len(c.text), len(c.token_ids), len(c.logprobs) if c.logprobs is not None else 0)
    return dataclasses.replace(output, outputs=completions)
