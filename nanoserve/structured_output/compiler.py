"""GrammarCompiler: the engine core's side of structured outputs.

Building llguidance's view of the tokenizer takes seconds (once, on the first structured request) and
a complex grammar can take a while to compile, so both happen on a worker thread and the scheduler
lets a request wait until its matcher is attached. Each distinct grammar is compiled once; later
requests with the same spec copy the compiled matcher. Bitmasks are filled on a second thread (llguidance
releases the GIL and fans out over its own threads) while the model runs the step's forward pass.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.numpy
import torch

from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.structured_output.grammar import grammar_text
from nanoserve.structured_output.matcher import GrammarMatcher

CACHE_SIZE = 128
"""Compiled grammars kept (least recently used dropped first)."""


class GrammarCompiler:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int) -> None:
        """load_tokenizer: returns the model's (fast) HF tokenizer; called once, on first use."""
        self.vocab_size = vocab_size
        self._load_tokenizer = load_tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-grammar")
        self._bitmask_pool = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-bitmask")
        self._executor: llguidance.LLExecutor | None = None
        """llguidance's thread pool for bitmasks, started with the first one."""

    def matcher(self, spec: StructuredOutputsParams, generated: list[int]) -> Future[GrammarMatcher]:
        """A matcher for `spec`, already advanced over `generated` (tokens a resumed request produced)."""
        return self._compile_pool.submit(self._build, spec, list(generated))

    def _build(self, spec: StructuredOutputsParams, generated: list[int]) -> GrammarMatcher:
        if self._tokenizer is None:
            # imports transformers, which an engine without structured requests never needs
            from llguidance.hf import from_tokenizer

            self._tokenizer = from_tokenizer(self._load_tokenizer(), n_vocab=self.vocab_size)
        grammar = grammar_text(spec)
        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
            if compiled.is_error():
                raise ValueError(f"structured_outputs.{spec.kind} is not valid: {compiled.get_error()}")
            self._compiled[grammar] = compiled
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        matcher = GrammarMatcher(compiled.deep_copy())
        if not matcher.accept_all(generated):
            raise ValueError(f"The tokens generated so far do not match the grammar: {matcher.error}")
        return matcher

    def fill_bitmask(self, matchers: list[tuple[GrammarMatcher, list[int]]]) -> Future[torch.Tensor]:
        """int32 [sum(1 + len(drafts)), ceil(vocab / 32)]: for each (matcher, draft tokens), the tokens it
        allows next, then after each draft token in turn (the matcher is left as it was). Rows past a
        draft token the grammar refuses allow everything: their positions are never kept."""
        return self._bitmask_pool.submit(self._fill, matchers)

    def _fill(self, matchers: list[tuple[GrammarMatcher, list[int]]]) -> torch.Tensor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        bitmask = llguidance.numpy.allocate_token_bitmask(
            sum(1 + len(drafts) for _, drafts in matchers), self.vocab_size
        )
        plain, drafted, row = [], [], 0
        for matcher, drafts in matchers:
            if drafts:
                drafted.append((matcher.matcher, row, drafts))
            else:
                plain.append((matcher.matcher, row))
            row += 1 + len(drafts)
        if plain:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if drafted:  # llguidance refuses empty draft lists
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask)
        return torch.from_numpy(bitmask)

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._bitmask_pool.shutdown(wait=False, cancel_futures=True)
