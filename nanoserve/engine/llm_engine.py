"""LLMEngine: the synchronous frontend engine. `add_request` tokenizes and validates, `step` runs one
engine step through the client and turns its outputs into `RequestOutput`s.

It holds three pieces in request order: Processor (prompt -> EngineCoreRequest), the engine-core client
(in this process or a child, chosen by `options.multiprocess_mode`), OutputProcessor (outputs -> text).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.base import EngineCoreClient
from nanoserve.engine.output_processor import OutputProcessor
from nanoserve.engine.processor import Processor, PromptType
from nanoserve.engine.startup import start_engine
from nanoserve.model_files import resolve_model_path
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.engine_core, files = start_engine(
            resolve_model_path(options.model),
            lambda: EngineCoreClient.make_client(options.multiprocess_mode, False, options),
        )
        self.tokenizer = files.tokenizer
        self.generation_defaults = files.generation_defaults
        ready = self.engine_core.ready_response
        self.max_model_len = ready.max_model_len
        self.processor = Processor.for_engine(self.tokenizer, ready, files.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._is_shut_down = False

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        final_output_only: bool = False,
    ) -> None:
        """Validate and queue a request; ValueError (and nothing queued) when it is invalid or its id is live.
        final_output_only: the caller reads only the finished output; without stop strings the engine then
        sends the first token and then chunks of tokens, not every step, so `step` returns this request's
        output less often (see EngineCoreRequest.final_output_only)."""
        self.add_requests([(request_id, prompt, params)], final_output_only)

    def add_requests(
        self,
        requests: Sequence[tuple[str, PromptType, SamplingParams | None]],
        final_output_only: bool = False,
    ) -> None:
        """Validate and queue (request id, prompt, params) triples as `add_request` does, all or none: the
        engine core gets them together, so a batch starts in one step and its requests finish together."""
        processed = []
        seen: set[str] = set()
        for request_id, prompt, params in requests:
            if request_id in self.output_processor.requests or request_id in seen:
                raise ValueError(f"Request id {request_id!r} is already running.")
            seen.add(request_id)
            params = params or SamplingParams(**self.generation_defaults)
            processed.append(self.processor.process(request_id, prompt, params, final_output_only))
        engine_requests = [
            engine_request
            for text, request in processed
            for engine_request in self.output_processor.add_request(request, text)
        ]
        try:
            self.engine_core.add_requests(engine_requests)
        except BaseException:
            with contextlib.suppress(Exception):  # the error worth raising is the one that got here
                self.abort_request([request.request_id for _, request in processed])
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        engine_ids = self.output_processor.abort_requests(request_ids)
        if engine_ids:
            self.engine_core.abort_requests(engine_ids)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs (finished or not, cumulative text) it advanced."""
        if not self.output_processor.has_unfinished_requests():
            return []
        engine_outputs = self.engine_core.get_output()
        request_outputs, to_abort = self.output_processor.process_outputs(engine_outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        return request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self.engine_core.shutdown()
