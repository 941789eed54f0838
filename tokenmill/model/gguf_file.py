"""A GGUF file's metadata and tensors (llama.cpp's format, versions 2 and 3).

The gguf package's GGUFReader keeps a numpy view for every part of every
value, which for a vocabulary's strings takes seconds; this reader decodes
each value once into plain Python (docs/perf-notes.md, start-up). Tensors are
views of the memory-mapped file in the layout GGUFReader gives them (dims
reversed to row-major; quantized types as uint8 rows of blocks), so that
`gguf.quants.dequantize` takes them as they are.

Layout (little-endian): magic "GGUF", version u32, tensor count u64, metadata
count u64; each metadata entry is a key string, a value type u32 and a value;
each tensor entry is a name, a dim count u32, dims u64 each, a type u32 and an
offset u64 into the data section, which starts at the next multiple of
`general.alignment` (default 32) after the entries. A string is a u64 length
and UTF-8 bytes; an array is an element type u32, a count u64 and elements.

The tensor table is checked as llama.cpp checks it: each tensor's offset is
the end of the one before, rounded up to the alignment, and its byte size is
what its type and shape make; the last ends within the file, and the file
ends within one alignment of it. A changed type, shape or offset breaks this
tiling, so it is an error naming the tensor rather than weights read from the
wrong bytes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

# Metadata value types -> (struct format, size) for the fixed-size ones.
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY_OF: dict[int, str] = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4",
    6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8",
}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS

# Tensor types stored as plain numpy items (the others are blocks of bytes).
_PLAIN_TYPES: dict[GGMLQuantizationType, type] = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands; the message says why."""


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: innermost dimension first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # a read-only view of the file


class GGUFFile:
    """`fields`: every metadata key with its value as Python (int, float, bool,
    str, or a list of them); `tensors`: in the file's order."""

    def __init__(self, path: str) -> None:
        self.path = path
        if os.path.getsize(path) == 0:
            raise GGUFFormatError(f"{path} is empty, not a GGUF file")
        self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._mv = memoryview(self._buf)  # type: ignore[arg-type]
        self._pos = 4  # after the magic
        if len(self._buf) < 24 or bytes(self._mv[:4]) != b"GGUF":
            raise GGUFFormatError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        version = self._read("<I", 4)
        if version not in (2, 3):
            raise GGUFFormatError(
                f"{path} is GGUF version {version}; versions 2 and 3 (little-endian) are "
                "supported: convert it again with a recent llama.cpp"
            )
        num_tensors = self._read("<Q", 8)
        num_fields = self._read("<Q", 8)
        try:
            self.fields: dict[str, Any] = {}
            for _ in range(num_fields):
                key = self._string()
                self.fields[key] = self._value(self._read("<I", 4))
            infos = [self._tensor_info() for _ in range(num_tensors)]
        except GGUFFormatError:
            raise
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as e:
            raise GGUFFormatError(f"{path} is truncated or corrupt ({e})") from e
        alignment = self.fields.get("general.alignment", 32)
        if (isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1
                or alignment & (alignment - 1)):
            raise GGUFFormatError(
                f"{path}: general.alignment={alignment!r} is invalid; it must be a power of two "
                "(usually 32)"
            )
        start = -(-self._pos // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        expected = 0  # where the next tensor must start, from the data section's start
        previous = ""  # the tensor before, for messages
        names: set[str] = set()
        for name, shape, raw_type, offset in infos:
            if name in names:
                raise GGUFFormatError(f"{path}: tensor {name} appears twice in the tensor table")
            names.add(name)
            tensor, nbytes = self._tensor(start, name, shape, raw_type, offset, expected, previous)
            self.tensors.append(tensor)
            expected = -(-(offset + nbytes) // alignment) * alignment
            previous = (f"tensor {name} ({tensor.tensor_type.name}, shape {list(shape)}: "
                        f"{nbytes} bytes)")
        trailing = len(self._buf) - (start + expected)
        if self.tensors and trailing >= alignment:  # more bytes than one padding
            raise GGUFFormatError(
                f"{path}: {trailing} bytes follow the last tensor's padding; the tensors do not "
                f"fill the data section (is {previous} of the wrong type or shape?)"
            )

    def _read(self, fmt: str, size: int) -> Any:
        value = struct.unpack_from(fmt, self._mv, self._pos)[0]
        self._pos += size
        return value

    def _string(self) -> str:
        n = self._read("<Q", 8)
        end = self._pos + n
        if end > len(self._buf):
            raise IndexError("a string runs past the end of the file")
        text = str(self._mv[self._pos:end], "utf-8")
        self._pos = end
        return text

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._read(*_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype = self._read("<I", 4)
            count = self._read("<Q", 8)
            if etype in _NUMPY_OF:  # numbers at once
                dtype = np.dtype(_NUMPY_OF[etype])
                values = np.frombuffer(self._mv, dtype, count, self._pos)
                self._pos += count * dtype.itemsize
                return values.tolist()
            return [self._value(etype) for _ in range(count)]
        raise GGUFFormatError(f"{self.path}: unknown metadata value type {vtype}")

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        ndim = self._read("<I", 4)
        shape = tuple(self._read("<Q", 8) for _ in range(ndim))
        return name, shape, self._read("<I", 4), self._read("<Q", 8)

    def _tensor(self, start: int, name: str, shape: tuple[int, ...], raw_type: int,
                offset: int, expected: int, previous: str) -> tuple[GGUFTensor, int]:
        """The tensor and its size in bytes, after checking its type, shape and offset."""
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(
                f"{self.path}: tensor {name} has unknown type {raw_type}"
            ) from None
        if not 1 <= len(shape) <= _MAX_DIMS or any(d < 1 for d in shape):
            raise GGUFFormatError(
                f"{self.path}: tensor {name} has shape {list(shape)}; a shape is 1 to "
                f"{_MAX_DIMS} dimensions of at least 1"
            )
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if shape[0] % block_size:
            raise GGUFFormatError(
                f"{self.path}: tensor {name} has type {qtype.name}, whose blocks hold "
                f"{block_size} values, but rows of {shape[0]} values (shape {list(shape)})"
            )
        count = math.prod(shape)  # Python ints: absurd dims cannot overflow
        nbytes = count // block_size * type_size
        if offset != expected:
            where = (f"the end of {previous}, rounded up to general.alignment" if previous
                     else "the data section's start")
            raise GGUFFormatError(
                f"{self.path}: tensor {name} has offset {offset}; it must be {expected}, "
                f"{where}: a tensor's type, shape or offset in the tensor table is wrong"
            )
        begin = start + offset
        if begin + nbytes > len(self._buf):
            raise GGUFFormatError(
                f"{self.path}: tensor {name} ({qtype.name}, shape {list(shape)}: {nbytes} bytes "
                f"at offset {offset}) runs past the end of the file"
            )
        rows = tuple(reversed(shape))  # row-major, as numpy and torch order them
        dtype: np.dtype[Any]
        if qtype in _PLAIN_TYPES:
            dtype = np.dtype(_PLAIN_TYPES[qtype])
        else:
            dtype = np.dtype(np.uint8)
            rows = quant_shape_to_byte_shape(rows, qtype)
        data = np.frombuffer(self._mv, dtype, nbytes // dtype.itemsize, begin).reshape(rows)
        return GGUFTensor(name, shape, qtype, data), nbytes


FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                         GGMLQuantizationType.BF16, GGMLQuantizationType.F64})


def holds_quantized_tensors(path: str) -> bool:
    """Whether any tensor of the GGUF file at `path` is stored in blocks of a
    quantized type (not a float type)."""
    return any(t.tensor_type not in FLOAT_TYPES for t in GGUFFile(path).tensors)
