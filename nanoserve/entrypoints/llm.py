"""LLM: offline, synchronous batch generation over an `LLMEngine`, with a progress bar."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import cast

from tqdm.auto import tqdm

from nanoserve.config import EngineOptions
from nanoserve.engine.exceptions import EngineGenerateError
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.processor import Conversation, PromptType
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams


class LLM:
    """`LLM(model=None, **engine_options)`; model None selects the bundled SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **options) -> None:
        self.llm_engine = LLMEngine(EngineOptions.from_kwargs(model, **options))
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use when given no SamplingParams: the defaults, overridden by the model's
        generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as
        vLLM's LLM does."""
        return SamplingParams(**self.llm_engine.generation_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt; the outputs come back in the prompts' order."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list | tuple) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            return self._run([cast(PromptType, prompts)], sampling_params, use_tqdm)
        return self._run(list(cast(Sequence[PromptType], prompts)), sampling_params, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of {"role", "content"} dicts) or to each of many."""
        if messages and isinstance(messages[0], dict):
            conversations = [cast(Conversation, messages)]
        else:
            conversations = list(cast(Sequence[Conversation], messages))
        processor = self.llm_engine.processor
        prompts: list[PromptType] = [processor.render_chat(c, add_generation_prompt) for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm)

    def _run(
        self,
        prompts: list[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"Got {len(params_list)} sampling params for {len(prompts)} prompts; pass one or one per prompt."
                )
        request_ids = [str(next(self._request_counter)) for _ in prompts]
        try:
            batch = list(zip(request_ids, prompts, params_list, strict=True))
            self.llm_engine.add_requests(batch, final_output_only=True)
            return self._run_engine(request_ids, use_tqdm)
        except BaseException:
            # leave the engine clean for the next call, whatever went wrong in this one
            self.llm_engine.abort_request(request_ids)
            raise

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        num_output_tokens = 0
        start = time.perf_counter()
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while len(finished) < len(request_ids):
                if not self.llm_engine.has_unfinished_requests():
                    raise RuntimeError("The engine dropped requests of this batch without finishing them.")
                for output in self.llm_engine.step():
                    if not output.finished:
                        continue
                    if output.error is not None:
                        raise EngineGenerateError(f"Request {output.request_id} failed: {output.error}")
                    finished[output.request_id] = output
                    num_output_tokens += sum(len(o.token_ids) for o in output.outputs)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"output: {num_output_tokens / max(elapsed, 1e-9):.1f} toks/s")
                    bar.update(1)
        return [finished[request_id] for request_id in request_ids]

    def shutdown(self) -> None:
        """Stop the engine; safe to call more than once (and from __del__ after a failed __init__)."""
        engine = getattr(self, "llm_engine", None)
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
