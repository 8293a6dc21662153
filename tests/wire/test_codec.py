"""The wire codec: typed round trips, out-of-band array frames, and frame sizes around pyzmq's copy
threshold (64 KiB) sent through real sockets with encode-buffer reuse."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from nanoserve.sampling_params import SamplingParams
from nanoserve.wire.codec import MsgpackDecoder, MsgpackEncoder
from nanoserve.wire.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreUtilityRequest,
    EngineDeathRecord,
    FinishReason,
    SchedulerStats,
    UtilityOutput,
)

COPY_THRESHOLD = zmq.COPY_THRESHOLD  # 65536: pyzmq copies smaller frames even with copy=False


def roundtrip(obj: Any, type_: Any = Any, threshold: int | None = None) -> Any:
    frames = MsgpackEncoder(threshold).encode(obj)
    return MsgpackDecoder(type_).decode([bytes(f) for f in frames])


@pytest.mark.timeout(30)
def test_typed_messages_roundtrip():
    req = EngineCoreRequest(
        "r1", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=7, stop=["x"]), [2, 7], 1.5
    )
    assert roundtrip(req, EngineCoreRequest) == req
    outs = EngineCoreOutputs(
        engine_index=0,
        outputs=[
            EngineCoreOutput(
                "r1", [5, 6], new_logprobs=[[(5, -0.1), (7, -2.0)]], finish_reason=FinishReason.LENGTH
            ),
            EngineCoreOutput("r2", [], finish_reason=FinishReason.ERROR, error="bad"),
        ],
        scheduler_stats=SchedulerStats(num_running_reqs=2),
        timestamp=3.0,
        finished_requests={"r1", "r2"},
    )
    got = roundtrip(outs, EngineCoreOutputs)
    assert got.outputs[0].finish_reason is FinishReason.LENGTH
    assert got.outputs[0].new_logprobs == [[(5, -0.1), (7, -2.0)]]
    assert got.finished_requests == {"r1", "r2"}
    death = EngineCoreOutputs(death=EngineDeathRecord(0, "RuntimeError", "boom", "tb"))
    assert roundtrip(death, EngineCoreOutputs).death == death.death
    util = EngineCoreUtilityRequest(9, "echo", ("a", 1))
    assert roundtrip(util, EngineCoreUtilityRequest).args == ("a", 1)


@pytest.mark.timeout(30)
def test_wrong_type_is_rejected():
    with pytest.raises(msgspec.ValidationError):
        roundtrip(EngineCoreUtilityRequest(1, "echo"), EngineCoreRequest)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8, np.float16, np.bool_])
def test_ndarray_inline_and_out_of_band(dtype):
    small = (np.arange(8) % 2).astype(dtype)
    large = (np.arange(1000) % 2).astype(dtype).reshape(10, 100)
    enc = MsgpackEncoder(256)
    frames = enc.encode({"small": small, "large": large})
    assert len(frames) == (2 if large.nbytes >= 256 else 1)
    got = MsgpackDecoder().decode(frames)
    np.testing.assert_array_equal(got["small"], small)
    np.testing.assert_array_equal(got["large"], large)
    assert got["large"].dtype == large.dtype and got["large"].shape == large.shape


@pytest.mark.timeout(30)
def test_out_of_band_decode_is_zero_copy():
    arr = np.arange(4096, dtype=np.float32)
    frames = MsgpackEncoder(256).encode(UtilityOutput(1, result=arr))
    aux = bytearray(frames[1])
    got = MsgpackDecoder(UtilityOutput).decode([frames[0], aux])
    aux[0:4] = np.float32(42.0).tobytes()  # the decoded array is a view over the received frame
    assert got.result[0] == 42.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool])
def test_tensor_roundtrip(dtype):
    for shape in [(), (0,), (3,), (64, 33)]:
        t = (torch.arange(int(np.prod(shape)) if shape else 1) % 3).to(dtype).reshape(shape)
        got = roundtrip([t], threshold=256)[0]
        assert got.dtype == dtype and tuple(got.shape) == shape
        assert torch.equal(got, t)


@pytest.mark.timeout(30)
def test_non_contiguous_and_unencodable():
    t = torch.arange(600, dtype=torch.float32).reshape(20, 30).t()
    assert torch.equal(roundtrip(t, threshold=16), t)
    a = np.arange(600).reshape(20, 30)[:, ::2]
    np.testing.assert_array_equal(roundtrip(a, threshold=16), a)
    with pytest.raises(TypeError):
        MsgpackEncoder().encode(object())


@pytest.mark.timeout(30)
def test_threshold_env(monkeypatch):
    monkeypatch.setenv("NANOSERVE_MSGPACK_ZERO_COPY_THRESHOLD", "1000000")
    assert len(MsgpackEncoder().encode(np.zeros(10000, np.uint8))) == 1
    monkeypatch.setenv("NANOSERVE_MSGPACK_ZERO_COPY_THRESHOLD", "16")
    assert len(MsgpackEncoder().encode(np.zeros(16, np.uint8))) == 2


def _sizes_around_copy_threshold() -> list[int]:
    rng = random.Random(1234)
    sizes = {COPY_THRESHOLD + d for d in (-4096, -257, -1, 0, 1, 255, 4096)}
    sizes |= {rng.randint(COPY_THRESHOLD - 8192, COPY_THRESHOLD + 8192) for _ in range(40)}
    sizes |= {rng.randint(1, 300) for _ in range(10)}
    return sorted(sizes)


@pytest.mark.timeout(60)
def test_frames_near_64k_through_zmq_with_buffer_reuse():
    """Property: whatever the sizes of the body and the out-of-band frames, and although the sender
    reuses its body buffer as soon as the tracker says done, every message decodes to what was sent."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    enc, dec = MsgpackEncoder(256), MsgpackDecoder(EngineCoreOutputs)
    rng = random.Random(7)
    free: list[bytearray] = []
    in_flight: list[tuple[zmq.MessageTracker, bytearray]] = []
    sent: list[EngineCoreOutputs] = []
    try:
        for size in _sizes_around_copy_threshold():
            # body size near `size` (token ids are 1-5 bytes each), plus an array of `size` bytes
            ids = [rng.randrange(0, 1 << 20) for _ in range(size // 4)]
            arr = np.frombuffer(rng.randbytes(size), dtype=np.uint8)
            msg = EngineCoreOutputs(
                outputs=[EngineCoreOutput(f"r{size}", ids)], utility_output=UtilityOutput(size, result=arr)
            )
            sent.append(msg)
            for t, b in list(in_flight):
                if t.done:
                    in_flight.remove((t, b))
                    free.append(b)
            buf = free.pop() if free else bytearray()
            frames = enc.encode_into(msg, buf)
            tracker = push.send(frames[0], zmq.SNDMORE if len(frames) > 1 else 0, copy=False, track=True)
            if len(frames) > 1:
                push.send_multipart(frames[1:], copy=False)
            in_flight.append((tracker, buf))
        for want in sent:
            got = dec.decode(pull.recv_multipart(copy=False))
            assert got.outputs[0].new_token_ids == want.outputs[0].new_token_ids
            np.testing.assert_array_equal(got.utility_output.result, want.utility_output.result)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
