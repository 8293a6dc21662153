"""A GGUF file's header in one pass: its metadata as Python values and its tensors as numpy views.

gguf's `GGUFReader` makes a numpy view for every part of every value, so a vocabulary of 49,152 tokens
and as many merges costs it 1.3-1.8 s on a Zen 5, on the start-up path of both the engine core and the
frontend. Here the values are unpacked with `struct` (about 0.06 s for the same header), and the type
codes, sizes and tensor byte shapes still come from the gguf package. The values match what
`GGUFReader`'s `ReaderField.contents()` gives (an array of arrays flattened, as it does), and each
tensor's `data` has the dtype and shape `GGUFReader` gives it, so `gguf.quants.dequantize` reads it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType, quant_shape_to_byte_shape

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
"""struct codes of the scalar value types, little-endian."""

_ELEMENT_DTYPES: dict[GGMLQuantizationType, type] = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
"""Tensor types read element by element; every other type is read as bytes, a row of blocks per row."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    """GGUF order: the fastest-varying dimension first (numpy's is the reverse)."""
    data: np.ndarray


class GGUFHeader:
    """`fields`: metadata key -> value; `tensors`: in file order, their data views of one read-only map."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as file:
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self._buffer = memoryview(self._map)
        self._offset = 0
        try:
            self._read(path)
        except (struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"{path!r} is a truncated or corrupt GGUF file: {e}") from e

    def _read(self, path: str) -> None:
        magic, version = self._unpack("<II")
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path!r} is not a GGUF file (magic {magic:#010x}).")
        if version & 0xFFFF == 0:
            raise ValueError(f"{path!r} is a big-endian GGUF file, which nanoserve does not read.")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"{path!r} is GGUF version {version}; nanoserve reads {SUPPORTED_VERSIONS}.")
        num_tensors, num_fields = self._unpack("<QQ")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"{path!r} has the metadata key {key!r} twice.")
            self.fields[key] = self._value(GGUFValueType(self._unpack("<I")[0]))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path!r} has an invalid general.alignment {alignment!r}.")
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError(f"{path!r} names a tensor twice.")

    def _unpack(self, layout: str) -> tuple[Any, ...]:
        values = struct.unpack_from(layout, self._buffer, self._offset)
        self._offset += struct.calcsize(layout)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        start = self._offset
        self._offset += length
        if self._offset > len(self._buffer):
            raise struct.error(f"a string of {length} bytes at offset {start} runs past the end")
        return str(self._buffer[start : self._offset], "utf-8")

    def _value(self, value_type: GGUFValueType) -> Any:
        if value_type == GGUFValueType.STRING:
            return self._string()
        if value_type in _SCALARS:
            return self._unpack("<" + _SCALARS[value_type])[0]
        if value_type != GGUFValueType.ARRAY:
            raise ValueError(f"unknown GGUF value type {value_type!r}")
        item_type, length = GGUFValueType(self._unpack("<I")[0]), self._unpack("<Q")[0]
        if item_type in _SCALARS:
            return list(self._unpack(f"<{length}{_SCALARS[item_type]}"))
        items = [self._value(item_type) for _ in range(length)]
        return [v for item in items for v in item] if item_type == GGUFValueType.ARRAY else items

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        (num_dims,) = self._unpack("<I")
        shape = self._unpack(f"<{num_dims}Q")
        tensor_type, offset = self._unpack("<IQ")
        return name, shape, GGMLQuantizationType(tensor_type), offset

    def _tensor(
        self, start: int, name: str, shape: tuple[int, ...], tensor_type: GGMLQuantizationType, offset: int
    ) -> GGUFTensor:
        numpy_shape = tuple(reversed(shape))
        num_elements = int(np.prod(shape))
        dtype = _ELEMENT_DTYPES.get(tensor_type)
        if dtype is None:
            block_size, block_bytes = GGML_QUANT_SIZES[tensor_type]
            dtype, count = np.uint8, num_elements * block_bytes // block_size
            numpy_shape = quant_shape_to_byte_shape(numpy_shape, tensor_type)
        else:
            count = num_elements
        if start + offset + count * np.dtype(dtype).itemsize > len(self._map):
            raise struct.error(f"tensor {name!r} runs past the end of the file")
        data = np.frombuffer(self._map, dtype, count, start + offset).reshape(numpy_shape)
        return GGUFTensor(name, tensor_type, shape, data)
