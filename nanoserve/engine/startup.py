"""A frontend's start: the engine core and the model's files load side by side.

A multiprocess engine core spends seconds in its child process importing torch and loading the weights,
while the frontend's thread only waits for its handshake; building the tokenizer from a GGUF file's
vocabulary and merges takes most of a second before the frontend has its tokenizer, generation defaults
and stop ids. Reading those on a thread of its own meanwhile makes the start the longer of the two
rather than their sum.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, NamedTuple

from nanoserve.engine.core_client.base import EngineCoreClient
from nanoserve.model_files import eos_token_ids, generation_defaults, load_tokenizer
from nanoserve.startup_gc import collector_paused


class FrontendFiles(NamedTuple):
    """What a frontend reads from the model's files."""

    tokenizer: Any
    generation_defaults: dict[str, Any]
    """SamplingParams fields the model's generation config sets (see nanoserve.model_files)."""
    eos_token_ids: tuple[int, ...]


def read_frontend_files(model_path: str) -> FrontendFiles:
    tokenizer = load_tokenizer(model_path)
    return FrontendFiles(tokenizer, generation_defaults(model_path), eos_token_ids(model_path, tokenizer))


def start_engine(
    model_path: str, make_client: Callable[[], EngineCoreClient]
) -> tuple[EngineCoreClient, FrontendFiles]:
    """make_client()'s engine core client and the model's frontend files, read while it starts, with the
    cyclic collector paused (nanoserve.startup_gc). Where the files fail to read, the started engine core
    is shut down before the error is raised; where the engine fails to start, its error is raised once the
    files' thread is done."""
    with (
        collector_paused(),
        concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanoserve-model-files") as pool,
    ):
        files = pool.submit(read_frontend_files, model_path)
        engine_core = make_client()
        try:
            return engine_core, files.result()
        except BaseException:
            engine_core.shutdown()
            raise
