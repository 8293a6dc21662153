"""nanoserve.gguf_header against the gguf package's own GGUFReader on the same files: every metadata value
(as ReaderField.contents() gives it) and every tensor's type, shape and data; and the files it refuses."""

from __future__ import annotations

import gc
import struct

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.gguf_header import GGUFHeader


def assert_same_as_gguf(path: str) -> None:
    reference = gguf.GGUFReader(path)
    header = GGUFHeader(path)
    # GGUFReader adds its own GGUF.version / tensor_count / kv_count entries
    want = {key: field.contents() for key, field in reference.fields.items() if not key.startswith("GGUF.")}
    assert list(header.fields) == list(want)
    for key, value in want.items():
        assert header.fields[key] == value and type(header.fields[key]) is type(value), key
    assert [t.name for t in header.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(header.tensors, reference.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type and list(mine.shape) == theirs.shape.tolist()
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data, equal_nan=True), mine.name


def test_the_bundled_model_reads_as_the_gguf_package_reads_it(bundled_gguf_path):
    assert_same_as_gguf(bundled_gguf_path)


def write_every_kind(path, alignment: int | None = None) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁wörld")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strings", ["a", "", "ĠThe", "<|im_end|>"])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_key_value("t.big", [2**63 + 1, 7], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT64)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 5)).astype(np.float16))
    for dtype in (np.int8, np.int16, np.int32, np.int64, np.float64):
        writer.add_tensor(np.dtype(dtype).name, np.arange(-3, 4, dtype=dtype).reshape(1, 7))
    for name, qtype in (("q4_0", "Q4_0"), ("q4_1", "Q4_1"), ("q8_0", "Q8_0"), ("bf16", "BF16")):
        ggml_type = gguf.GGMLQuantizationType[qtype]
        weights = rng.standard_normal((4, 64)).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(weights, ggml_type), raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("alignment", "version"), [(None, 3), (64, 3), (None, 2)])
def test_every_value_type_and_tensor_type_reads_as_the_gguf_package_reads_it(tmp_path, alignment, version):
    path = tmp_path / "every-kind.gguf"
    write_every_kind(path, alignment)
    with open(path, "r+b") as f:  # version 2 has version 3's layout
        f.seek(4)
        f.write(struct.pack("<I", version))
    assert_same_as_gguf(str(path))
    assert GGUFHeader(str(path)).fields["t.nested"] == [1, 2, 3]  # flattened, as GGUFReader does


def test_tensor_data_outlives_the_header(tmp_path):
    path = tmp_path / "every-kind.gguf"
    write_every_kind(path)
    data = {t.name: t.data for t in GGUFHeader(str(path)).tensors}
    gc.collect()
    assert data["int64"].tolist() == [list(range(-3, 4))]


@pytest.mark.parametrize("keep", [200, -10], ids=["in-the-metadata", "in-the-last-tensor"])
def test_a_truncated_file_is_refused_by_name(tmp_path, keep):
    path = tmp_path / "every-kind.gguf"
    write_every_kind(path)
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ValueError, match="every-kind.gguf' is a truncated or corrupt GGUF file"):
        GGUFHeader(str(path))


@settings(max_examples=25, deadline=None)
@given(
    values=st.dictionaries(
        st.text(min_size=1, max_size=12),
        st.one_of(
            st.integers(-(2**31), 2**31 - 1),
            st.floats(allow_nan=False, width=32),
            st.text(max_size=20),
            st.booleans(),
            st.lists(st.text(max_size=8), min_size=1, max_size=6),
            st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=6),
        ),
        max_size=8,
    )
)
def test_arbitrary_metadata_reads_as_the_gguf_package_reads_it(tmp_path_factory, values):
    path = tmp_path_factory.mktemp("gguf") / "metadata.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in values.items():
        writer.add_key_value(f"x.{key}", value, _value_type(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf(str(path))


def _value_type(value) -> gguf.GGUFValueType:
    if isinstance(value, list):
        return gguf.GGUFValueType.ARRAY
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.INT32
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    return gguf.GGUFValueType.STRING


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"GGML" + struct.pack("<I", 3), "not a GGUF file"),
        (struct.pack("<I", gguf.GGUF_MAGIC) + struct.pack(">I", 3), "big-endian"),
        (struct.pack("<II", gguf.GGUF_MAGIC, 1), "version 1"),
    ],
)
def test_files_it_cannot_read_are_refused_by_name(tmp_path, header, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(header + struct.pack("<QQ", 0, 0))
    with pytest.raises(ValueError, match=message):
        GGUFHeader(str(path))
