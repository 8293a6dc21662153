"""EngineCore: schedule -> run the model -> sample -> update requests, one step at a time.

It is synchronous and knows nothing of processes or sockets: `InprocClient` calls it directly and
`EngineCoreProc` wraps it in a child process. Utilities are dispatched from an explicit allow-list.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch

from nanoserve import envs
from nanoserve.config import EngineOptions
from nanoserve.core.request import Request, RequestStatus
from nanoserve.core.scheduler import Scheduler
from nanoserve.structured_output.compiler import GrammarCompiler
from nanoserve.structured_output.matcher import GrammarMatcher
from nanoserve.wire.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    FinishReason,
)

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.01
"""How long a step with nothing to run waits for a compiling grammar before returning (no busy spin)."""
UTILITIES = (
    "reset_prefix_cache",
    "profile",
    "sleep",
    "wake_up",
    "is_sleeping",
    "collective_rpc",
    "save_sharded_state",
    "echo",
)


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _build_runner(options: EngineOptions):
    if options.runner == "null":
        from nanoserve.model.null_runner import NullRunner

        return NullRunner(options)
    from nanoserve.model.runner import ModelRunner

    return ModelRunner(options)


class EngineCore:
    def __init__(
        self,
        options: EngineOptions,
        engine_rank: int = 0,
        on_phase: Callable[[str], None] | None = None,
    ) -> None:
        report = on_phase or (lambda phase: None)
        self.options = options
        self.engine_rank = engine_rank
        torch.set_num_threads(options.num_threads or available_cpus())

        report("loading_weights")
        self.runner = _build_runner(options)
        try:
            self.num_kv_blocks = self._num_kv_blocks()
            self.max_model_len = self._fit_max_model_len(self.num_kv_blocks)
            self.runner.allocate_kv_cache(self.num_kv_blocks)
            self.runner.load_weights()
            self.runner.wait_for_kv_cache()
        except BaseException:
            self.runner.free_kv_cache()  # its pages may still be being written
            raise
        self.scheduler = Scheduler(
            options, self.num_kv_blocks, self.max_model_len, self.runner.sliding_window
        )

        self.grammars = GrammarCompiler(self._load_tokenizer, self.runner.vocab_size)
        self._compiling: dict[str, tuple[Request, Future[GrammarMatcher]]] = {}
        """Structured-output requests whose matcher is still being built."""
        self._pending_outputs: list[EngineCoreOutput] = []
        self._held_requests: list[Request] = []
        """Requests that arrived while the engine sleeps or waits to sleep; admitted on wake_up."""
        self._sleep_level = 0
        self._sleep_waiters: list[tuple[Future, int]] = []
        self._profiler: torch.profiler.profile | None = None
        self.ready_response = EngineCoreReadyResponse(
            engine_rank=engine_rank,
            num_kv_blocks=self.num_kv_blocks,
            block_size=options.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.runner.vocab_size,
            dtype=self.runner.dtype_name,
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
        )

    def _load_tokenizer(self):
        from nanoserve.model_files import load_tokenizer, resolve_model_path

        return load_tokenizer(resolve_model_path(self.options.model))

    def _num_kv_blocks(self) -> int:
        if self.options.num_kv_blocks is not None:
            return self.options.num_kv_blocks
        budget = self.options.kv_cache_budget
        num_blocks = budget // self.runner.kv_cache_bytes_per_block()
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} is smaller than one KV block "
                f"({self.runner.kv_cache_bytes_per_block()} bytes); raise it."
            )
        return num_blocks

    def _fit_max_model_len(self, num_blocks: int) -> int:
        model_limit = self.runner.max_model_len
        capacity = num_blocks * self.options.block_size
        requested = self.options.max_model_len
        if requested is None:
            return min(model_limit, capacity)
        if requested > model_limit:
            raise ValueError(f"max_model_len={requested} exceeds the model's context length ({model_limit}).")
        if requested > capacity:
            raise ValueError(
                f"max_model_len={requested} does not fit in the KV cache ({num_blocks} blocks x "
                f"{self.options.block_size} tokens = {capacity}); raise kv_cache_memory_bytes or num_kv_blocks, "
                "or lower max_model_len."
            )
        return requested

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Admit a request, or finish it at once with an ERROR output saying why it was refused."""
        error = self._validate(request)
        if error is not None:
            self._pending_outputs.append(
                EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR, error=error)
            )
            return
        params = request.sampling_params
        room = self.max_model_len - len(request.prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        engine_request = Request.from_engine_core_request(request, max_tokens)
        spec = params.structured_outputs
        if spec is not None:
            # a resumed request has output tokens already: its matcher starts after them
            future = self.grammars.matcher(spec, engine_request.output_token_ids)
            self._compiling[engine_request.request_id] = (engine_request, future)
        if self._sleep_level or self._sleep_waiters:
            self._held_requests.append(engine_request)
        else:
            self.scheduler.add_request(engine_request)

    def _validate(self, request: EngineCoreRequest) -> str | None:
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            return "The prompt is empty."
        if num_prompt >= self.max_model_len:
            return (
                f"The prompt ({num_prompt} tokens) is longer than the maximum model length "
                f"({self.max_model_len}) minus one generated token."
            )
        vocab = self.runner.vocab_size
        if min(request.prompt_token_ids) < 0 or max(request.prompt_token_ids) >= vocab:
            return f"Prompt token ids must be in [0, {vocab})."
        resumed = request.resumed_output_token_ids or []
        if resumed and (min(resumed) < 0 or max(resumed) >= vocab):
            return f"Resumed output token ids must be in [0, {vocab})."
        max_tokens = request.sampling_params.max_tokens
        if num_prompt + len(resumed) >= self.max_model_len or (
            max_tokens is not None and len(resumed) >= max_tokens
        ):
            return "A resumed request must have at least one token left to generate."
        if self.scheduler.has_request(request.request_id) or any(
            r.request_id == request.request_id for r in self._held_requests
        ):
            return f"Request id {request.request_id!r} is already in use."
        try:
            request.sampling_params.validate()
        except ValueError as e:
            return str(e)
        return None

    def abort_requests(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        held = [r for r in self._held_requests if r.request_id in ids]
        self._held_requests = [r for r in self._held_requests if r.request_id not in ids]
        self._pending_outputs.extend(
            EngineCoreOutput(r.request_id, [], finish_reason=FinishReason.ABORT) for r in held
        )
        self._pending_outputs.extend(
            self.scheduler.finish_requests(list(ids), RequestStatus.FINISHED_ABORTED)
        )

    def has_work(self) -> bool:
        if self._pending_outputs:
            return True
        return not self._sleep_level and self.scheduler.has_unfinished_requests()

    # -- stepping -----------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        outputs, self._pending_outputs = self._pending_outputs, []
        if not self._sleep_level:
            outputs.extend(self._attach_grammars())
            scheduled = self.scheduler.schedule()
            if not scheduled.is_empty:
                matchers = [
                    (c.request.grammar, c.draft_token_ids)
                    for c in scheduled.chunks
                    if c.samples and c.request.grammar
                ]
                if matchers:  # filled while the model runs
                    scheduled.grammar_bitmask = self.grammars.fill_bitmask(matchers)
                start = time.perf_counter()
                runner_output = self.runner.execute(scheduled)
                if self.scheduler.speculator is not None:
                    self.scheduler.speculator.observe_step(scheduled, time.perf_counter() - start)
                outputs.extend(self.scheduler.update_from_output(scheduled, runner_output))
            elif self._compiling and not outputs:
                wait([f for _, f in self._compiling.values()], GRAMMAR_WAIT_S, FIRST_COMPLETED)
        finished = {o.request_id for o in outputs if o.finish_reason is not None}
        return EngineCoreOutputs(
            engine_index=self.engine_rank,
            outputs=outputs,
            scheduler_stats=self.scheduler.get_stats(),
            timestamp=time.monotonic(),
            finished_requests=finished or None,
        )

    def _attach_grammars(self) -> list[EngineCoreOutput]:
        """Attach the matchers compiled since the last step; fail the requests whose grammar failed."""
        outputs: list[EngineCoreOutput] = []
        for request_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            if request.is_finished:
                continue
            error = future.exception()
            if error is None:
                request.grammar = future.result()
            else:
                outputs.extend(
                    self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ERROR, str(error))
                )
        return outputs

    def post_step(self) -> None:
        """Complete a pending sleep(mode="wait") once the running requests have finished."""
        if self._sleep_waiters and not self.scheduler.has_unfinished_requests():
            waiters, self._sleep_waiters = self._sleep_waiters, []
            self._enter_sleep(max(level for _, level in waiters))
            for future, _ in waiters:
                if not future.done():
                    future.set_result(None)

    # -- utilities ----------------------------------------------------------------------------

    def call_utility(self, method: str, args: tuple = ()) -> Any:
        if method not in UTILITIES:
            raise ValueError(f"{method!r} is not an engine utility; allowed: {', '.join(UTILITIES)}.")
        return getattr(self, method)(*args)

    def echo(self, value: Any) -> Any:
        return value

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def profile(self, is_start: bool = True) -> None:
        """Start or stop a torch profiler trace, written to NANOSERVE_TORCH_PROFILER_DIR (default ./profiles)."""
        if is_start:
            if self._profiler is None:
                self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self._profiler.start()
            return
        if self._profiler is not None:
            self._profiler.stop()
            out_dir = envs.torch_profiler_dir()
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, f"engine{self.engine_rank}-{int(time.time())}.pt.trace.json")
            self._profiler.export_chrome_trace(path)
            logger.info("profiler trace written to %s", path)
            self._profiler = None

    def sleep(self, level: int = 1, mode: str = "abort") -> Future | None:
        """Level 1 frees the KV cache and offloads weights; level 2 also drops the weights.

        mode="abort" aborts in-flight requests and sleeps now; mode="wait" stops admitting new requests
        and returns a future that completes once the running ones have finished.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}.")
        if mode not in ("abort", "wait"):
            raise ValueError(f"sleep mode must be 'abort' or 'wait', got {mode!r}.")
        if mode == "wait":
            future: Future = Future()
            self._sleep_waiters.append((future, level))
            self.post_step()
            return future
        running = [*self.scheduler.request_ids(), *(r.request_id for r in self._held_requests)]
        self.abort_requests(running)
        self._enter_sleep(level)
        return None

    def _enter_sleep(self, level: int) -> None:
        if self._sleep_level >= level:
            return
        self.scheduler.reset_prefix_cache()
        if not self._sleep_level:
            self.runner.free_kv_cache()
        if level == 2:
            self.runner.drop_weights()
        else:
            self.runner.offload_weights()
        self._sleep_level = level

    def wake_up(self) -> None:
        if self._sleep_level:
            self.runner.allocate_kv_cache(self.num_kv_blocks)
            self.runner.restore_weights()
            self.runner.wait_for_kv_cache()
            self._sleep_level = 0
        for request in self._held_requests:
            self.scheduler.add_request(request)
        self._held_requests = []

    def is_sleeping(self) -> bool:
        return bool(self._sleep_level)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call a method on every worker (here: the one model runner) and return their results."""
        if method not in self.runner.RPC_METHODS:
            raise ValueError(
                f"{method!r} is not a worker RPC; allowed: {', '.join(self.runner.RPC_METHODS)}."
            )
        return [getattr(self.runner, method)(*args, **(kwargs or {}))]

    def save_sharded_state(self, path: str) -> None:
        self.runner.save_state(path)

    def shutdown(self) -> None:
        self.grammars.shutdown()
        if self._profiler is not None:
            self.profile(is_start=False)
        for future, _ in self._sleep_waiters:
            if not future.done():
                future.cancel()
        self._sleep_waiters = []
