"""NullRunner: a model-free runner that answers every scheduled request at once.

It lets the IPC benchmark and the client tests exercise scheduling, the wire and the client layer
without paying for a forward pass. Each sampling request gets one deterministic token per step, a
function of its length; draft tokens are accepted where they equal what it would give there.
"""

from __future__ import annotations

from nanoserve.config import EngineOptions
from nanoserve.model.batch import RunnerOutput, SchedulerOutput

NULL_VOCAB_SIZE = 49152
NULL_MAX_MODEL_LEN = 8192
_FIRST_ORDINARY_TOKEN = 3  # ids 0-2 are unk/bos/eos in the bundled tokenizer


class NullRunner:
    RPC_METHODS = ("describe",)

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.vocab_size = NULL_VOCAB_SIZE
        self.max_model_len = NULL_MAX_MODEL_LEN
        self.dtype_name = "none"
        self.sliding_window = None

    def kv_cache_bytes_per_block(self) -> int:
        return self.options.block_size * 64

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def wait_for_kv_cache(self) -> None:
        pass

    def free_kv_cache(self) -> None:
        pass

    def load_weights(self) -> None:
        pass

    def offload_weights(self) -> None:
        pass

    def drop_weights(self) -> None:
        pass

    def restore_weights(self) -> None:
        pass

    def describe(self) -> str:
        return "null runner"

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        ids, tokens = [], []
        span = self.vocab_size - _FIRST_ORDINARY_TOKEN
        for chunk in scheduled.chunks:
            if chunk.samples:
                ids.append(chunk.request.request_id)
                num_tokens = chunk.request.num_tokens
                kept = [_FIRST_ORDINARY_TOKEN + num_tokens % span]
                for i, draft in enumerate(chunk.draft_token_ids):
                    if draft != kept[-1]:
                        break
                    kept.append(_FIRST_ORDINARY_TOKEN + (num_tokens + i + 1) % span)
                tokens.append(kept)
        return RunnerOutput(ids, tokens, [None] * len(ids))

    def save_state(self, path: str) -> None:
        raise ValueError("The null runner has no weights to save.")
