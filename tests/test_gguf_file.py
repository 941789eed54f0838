"""GGUFFile reads what the gguf package's GGUFReader reads, value for value."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from tokenmill.model.gguf_file import GGUFFile, GGUFFormatError

TENSOR_TYPES = [
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
    gguf.GGMLQuantizationType.Q8_0,
    gguf.GGMLQuantizationType.Q4_1,
    gguf.GGMLQuantizationType.Q4_0,
]


def _write(path: Path, alignment: int | None = None) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_block_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_uint8("test.u8", 200)
    writer.add_int8("test.i8", -3)
    writer.add_uint16("test.u16", 60000)
    writer.add_int16("test.i16", -30000)
    writer.add_int32("test.i32", -7)
    writer.add_uint64("test.u64", 2**40)
    writer.add_int64("test.i64", -(2**40))
    writer.add_float64("test.f64", 0.1)
    writer.add_bool("test.bool", True)
    writer.add_string("test.text", "héllo, wörld ✓")
    writer.add_array("test.floats", [0.5, -1.25, 3.0])
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_token_list(["<s>", "a", " b", "ć", ""])
    writer.add_token_types([3, 1, 1, 1, 1])
    writer.add_token_merges(["a b", "Ġ b"])
    rng = np.random.default_rng(0)
    for i, qtype in enumerate(TENSOR_TYPES):
        weight = rng.standard_normal((3, 64)).astype(np.float32)
        data = quantize(weight, qtype)
        writer.add_tensor(f"blk.{i}.w", data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    writer.add_tensor("ints", np.arange(5, dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_reads_what_gguf_reader_reads(tmp_path: Path, alignment: int | None) -> None:
    path = tmp_path / "m.gguf"
    _write(path, alignment)
    ref = gguf.GGUFReader(str(path))
    ours = GGUFFile(str(path))
    # (GGUFReader lists the header as fields too: GGUF.version, .tensor_count, .kv_count.)
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(ref_fields)
    for key, field in ref_fields.items():
        if key == "test.nested":  # GGUFReader.contents() flattens arrays of arrays
            continue
        expected = field.contents()
        assert ours.fields[key] == expected, key
        assert type(ours.fields[key]) is type(expected), key
    assert ours.fields["test.text"] == "héllo, wörld ✓"
    assert ours.fields["test.nested"] == [[1, 2], [3]]
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
        assert mine.shape == tuple(int(d) for d in theirs.shape)
        assert mine.tensor_type == theirs.tensor_type
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data), mine.name
        if mine.tensor_type == gguf.GGMLQuantizationType.I32:
            continue
        np.testing.assert_array_equal(
            gguf.quants.dequantize(mine.data, mine.tensor_type),
            gguf.quants.dequantize(theirs.data, theirs.tensor_type),
        )


def test_bad_files_get_a_clear_error(tmp_path: Path) -> None:
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFFormatError, match="is not a GGUF file"):
        GGUFFile(str(not_gguf))

    empty = tmp_path / "e.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFFormatError, match="is empty"):
        GGUFFile(str(empty))

    good = tmp_path / "m.gguf"
    _write(good)
    blob = good.read_bytes()
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(blob[:200])
    with pytest.raises(GGUFFormatError, match="truncated or corrupt"):
        GGUFFile(str(truncated))
    no_data = tmp_path / "n.gguf"
    no_data.write_bytes(blob[: len(blob) - 40])
    with pytest.raises(GGUFFormatError, match="runs past the end of the file"):
        GGUFFile(str(no_data))

    # A metadata array claiming more numbers than the file holds.
    huge = bytearray(blob)
    key = b"test.floats"
    at = huge.index(key) + len(key) + 4 + 4  # past the key, the value type and the element type
    huge[at:at + 8] = (2**40).to_bytes(8, "little")
    bad_count = tmp_path / "c.gguf"
    bad_count.write_bytes(bytes(huge))
    with pytest.raises(GGUFFormatError, match="truncated or corrupt"):
        GGUFFile(str(bad_count))

    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(100))
    with pytest.raises(GGUFFormatError, match="version 1"):
        GGUFFile(str(old))
