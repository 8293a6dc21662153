"""Everything that crosses the frontend <-> engine-core boundary, in one place.

Frontend -> engine (ROUTER -> DEALER, identity = engine rank as 2 bytes little-endian):
    [identity, EngineCoreRequestType, *encoded payload]
Engine -> frontend (PUSH -> PULL): one encoded `EngineCoreOutputs` per message, or, when an engine
dies, an `EngineCoreOutputs` carrying an `EngineDeathRecord` followed by the single frame
`ENGINE_CORE_DEAD`. Start-up: the engine reports `EngineHandshakePhase`s and ends with an
`EngineCoreReadyResponse`. The in-process client passes the same objects without encoding them.
Data parallel: each engine pushes an `EngineLoad` to the coordinator when its counts change (PUSH ->
PULL); the coordinator publishes a `DPLoadUpdate` to the frontends (PUB -> SUB).

Restarts: a rank restarted after a death keeps its identity and sockets; its `incarnation` (how many
times it was started before) is stamped on everything it sends, so a message still in flight from a
dead incarnation is told apart and dropped. A request it held is sent again with the tokens already
delivered to the frontend (`resumed_output_token_ids`), and the engine continues it from there.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from nanoserve.sampling_params import SamplingParams

ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


def engine_identity(rank: int) -> bytes:
    """The ZMQ identity of an engine rank: the engine's DEALER sets it, the frontend's ROUTER routes by it."""
    return rank.to_bytes(2, "little")


class EngineCoreRequestType(bytes, enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"
    """Payload None: drain as on SIGTERM, then exit (a rank on another machine gets no signal from us)."""


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []
    """Every token that ends the sequence (Llama 3 declares several)."""
    arrival_time: float = 0.0
    resumed_output_token_ids: list[int] | None = None
    """A request replayed on a restarted engine: the output tokens the frontend already has. The engine
    takes them as produced (max_tokens, min_tokens, penalties and the seeded stream count them) and
    generates what follows."""
    final_output_only: bool = False
    """Deliver the first output token at once, the others in chunks (nanoserve.core.scheduler.MAX_HELD_TOKENS)
    and at the finish, not step by step: for a caller that wants only the finished result and has no stop
    strings for the frontend to match (`LLM.generate`, the server's requests without `stream`). Most steps
    then send nothing for it, which spares both processes a message and its handling per step."""


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[list[tuple[int, float]]] | None = None
    """Per new token: [(sampled_id, logprob), (top1_id, logprob), ...]; None unless requested."""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    """The stop token id that ended the request, when one did."""
    num_cached_tokens: int = 0
    error: str | None = None
    """Why the engine refused or failed this request (finish_reason is then ERROR)."""
    queued_time: float = 0.0
    scheduled_time: float = 0.0
    """When the engine queued the request and first scheduled it (its time.monotonic()); sent with the
    request's first token only, for the queue / prefill / decode histograms."""
    prompt_logprobs: list[list[tuple[int, float]]] | None = None
    """With the first token, when asked: per prompt token from the second on,
    [(its id, logprob), (top1_id, logprob), ...]."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    """Speculative decoding: draft tokens verified and accepted, since the engine started."""


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    failure_message: str | None = None
    result: Any = None


class EngineDeathRecord(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Why an engine core died, sent just before ENGINE_CORE_DEAD when the engine can still speak."""

    engine_rank: int
    exc_type: str
    message: str
    traceback_tail: str = ""


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: set[str] | None = None
    death: EngineDeathRecord | None = None
    incarnation: int = 0
    """Of the sending rank (see the module docstring)."""


class EngineCoreUtilityRequest(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    method: str
    args: tuple = ()
    client_index: int = 0


class EngineHandshakePhase(msgspec.Struct, array_like=True, gc=False):
    engine_rank: int
    phase: str
    """One of: started, loading_weights (the KV cache is allocated meanwhile), ready."""
    incarnation: int = 0


class EngineCoreReadyResponse(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The capacity the engine actually computed; the frontend schedules and validates against it."""

    engine_rank: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int


class EngineLoad(msgspec.Struct, array_like=True, gc=False):
    """Engine -> data-parallel coordinator: this rank's queue lengths and KV use, sent when they change."""

    engine_rank: int
    num_waiting_reqs: int = 0
    num_running_reqs: int = 0
    kv_cache_usage: float = 0.0


class DPLoadUpdate(msgspec.Struct, array_like=True, gc=False):
    """Coordinator -> frontends: every rank's latest load, on change (at most every 100 ms) and as a
    heartbeat when nothing changes."""

    loads: list[EngineLoad]
    seq: int
    is_heartbeat: bool = False
