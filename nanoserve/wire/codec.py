"""msgpack encoding of wire messages, with large arrays carried as separate zero-copy frames.

`MsgpackEncoder.encode(obj)` returns a list of frames: frame 0 is the msgpack body, frames 1..n are
the raw bytes of every numpy array / torch tensor of at least `NANOSERVE_MSGPACK_ZERO_COPY_THRESHOLD`
bytes (default 256). The body refers to them by index through a msgpack extension, so the bytes are
never copied into it; smaller arrays are inlined. `MsgpackDecoder.decode(frames)` rebuilds arrays as
views over the received frames (no copy). Because the extension is decoded by `ext_hook`, arrays
round-trip in `Any` positions too (utility arguments and results). torch is imported only when a tensor
arrives: a frontend that starts an engine core then spawns it before spending seconds importing torch.

The sender must keep the encoded frames alive until ZMQ has sent them (`track=True`); an encoder or
decoder instance is not thread-safe (it keeps the frames of the message in flight).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from nanoserve import envs

# msgpack extension codes: (dtype, shape) header plus either inline bytes or an out-of-band frame index
_EXT_NDARRAY_INLINE = 1
_EXT_NDARRAY_OOB = 2
_EXT_TENSOR_INLINE = 3
_EXT_TENSOR_OOB = 4

Frame = bytes | bytearray | memoryview


def zero_copy_threshold() -> int:
    return envs.msgpack_zero_copy_threshold()


def _tensor_dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class MsgpackEncoder:
    def __init__(self, size_threshold: int | None = None) -> None:
        self.size_threshold = zero_copy_threshold() if size_threshold is None else size_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._aux: list[Frame] | None = None
        self._header = msgspec.msgpack.Encoder()

    def encode(self, obj: Any) -> list[Frame]:
        aux: list[Frame] = [b""]
        self._aux = aux
        try:
            aux[0] = self._encoder.encode(obj)
            return aux
        finally:
            self._aux = None

    def encode_into(self, obj: Any, buf: bytearray) -> list[Frame]:
        """Like `encode`, but write the body into `buf` (resized to fit) so it can be reused."""
        aux: list[Frame] = [buf]
        self._aux = aux
        try:
            self._encoder.encode_into(obj, buf)
            return aux
        finally:
            self._aux = None

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise TypeError("numpy arrays of Python objects cannot be encoded.")
            arr = np.ascontiguousarray(obj)
            return self._array_ext(_EXT_NDARRAY_INLINE, _EXT_NDARRAY_OOB, arr.dtype.str, arr.shape, arr)
        torch = sys.modules.get("torch")  # a tensor exists only once torch is imported
        if torch is not None and isinstance(obj, torch.Tensor):
            tensor = obj.detach().cpu().contiguous()
            # a uint8 view exposes the bytes of any dtype (bfloat16 has no numpy equivalent)
            raw = tensor.reshape(-1).view(torch.uint8).numpy()
            return self._array_ext(
                _EXT_TENSOR_INLINE, _EXT_TENSOR_OOB, _tensor_dtype_name(tensor), tuple(tensor.shape), raw
            )
        raise TypeError(f"Objects of type {type(obj).__name__} cannot be sent over the engine wire.")

    def _array_ext(
        self, inline_code: int, oob_code: int, dtype: str, shape: tuple, arr: Any
    ) -> msgspec.msgpack.Ext:
        aux = self._aux
        if arr.nbytes >= self.size_threshold and aux is not None and arr.nbytes > 0:
            aux.append(arr.data)
            return msgspec.msgpack.Ext(oob_code, self._header.encode((dtype, shape, len(aux) - 1)))
        return msgspec.msgpack.Ext(inline_code, self._header.encode((dtype, shape, arr.tobytes())))


def _buffer(frame: Any) -> memoryview:
    """A zmq.Frame's buffer, or a view of bytes-like data (no copy either way)."""
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


class MsgpackDecoder:
    def __init__(self, type_: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook, dec_hook=self._dec_hook)
        self._header = msgspec.msgpack.Decoder(tuple)
        self._frames: Sequence[memoryview] = ()

    def decode(self, frames: Sequence[Any] | Frame) -> Any:
        if isinstance(frames, bytes | bytearray | memoryview):
            frames = (frames,)
        bufs = [_buffer(f) for f in frames]
        self._frames = bufs
        try:
            return self._decoder.decode(bufs[0])
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        dtype, shape, payload = self._header.decode(data)
        if code in (_EXT_NDARRAY_OOB, _EXT_TENSOR_OOB):
            payload = self._frames[payload]
        if code in (_EXT_NDARRAY_INLINE, _EXT_NDARRAY_OOB):
            return np.frombuffer(payload, dtype=np.dtype(dtype)).reshape(shape)
        if code in (_EXT_TENSOR_INLINE, _EXT_TENSOR_OOB):
            try:
                import torch
            except ImportError as e:
                raise TypeError("received a torch tensor but torch is not installed.") from e
            torch_dtype = getattr(torch, dtype)
            if len(payload) == 0:
                return torch.empty(shape, dtype=torch_dtype)
            with warnings.catch_warnings():
                # received frames are read-only; the tensor is a view that callers must not write to
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.frombuffer(payload, dtype=torch_dtype)
            tensor = tensor.reshape(shape)
            return tensor.clone() if code == _EXT_TENSOR_INLINE else tensor
        raise TypeError(f"unknown msgpack extension code {code}.")

    @staticmethod
    def _dec_hook(type_: type, obj: Any) -> Any:
        if isinstance(obj, type_):
            return obj
        raise TypeError(f"cannot decode {type(obj).__name__} as {type_.__name__}.")
