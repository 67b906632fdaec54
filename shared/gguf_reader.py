"""GGUF header reader: metadata and tensor index, parsed in one pass.

gguf.GGUFReader builds several numpy views per array element, which costs ~9 s for Gemma 3's
262k-token vocabulary before a single weight is touched. This reads the same format (GGUF v2/v3,
little-endian) with plain slicing: numeric arrays become numpy arrays, string arrays Python
lists, in well under a second. Type codes and block sizes come from the gguf package; tensor
data is left on disk for the caller to memory-map.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
          GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
          GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_, GGUFValueType.UINT64: np.uint64,
          GGUFValueType.INT64: np.int64, GGUFValueType.FLOAT64: np.float64}


class GGUFFormatError(ValueError):
    """The bytes are not a well-formed GGUF file; the message says where."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost (row length) first
    qtype: int
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    fields: dict[str, object]
    tensors: list[TensorInfo]


class _Cursor:
    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise GGUFFormatError(f"truncated file: needed {n} bytes at offset {self.pos}, file has {self.size}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("<Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFFormatError(f"text that is not UTF-8 at offset {self.pos - len(raw)}") from None

    def value(self, vtype: int):
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        if vtype not in _SCALARS:
            raise GGUFFormatError(f"unknown value type {vtype} at offset {self.pos}")
        return self.scalar(_SCALARS[GGUFValueType(vtype)])

    def array(self):
        etype, count = self.scalar("<I"), self.scalar("<Q")
        if etype in _NUMPY:
            dtype = np.dtype(_NUMPY[GGUFValueType(etype)])
            return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).copy()
        if etype == GGUFValueType.STRING:
            return [self.string() for _ in range(count)]
        return [self.value(etype) for _ in range(count)]  # arrays of arrays: rare, slow is fine


def read_header(path: str | Path) -> GGUFHeader:
    """Metadata and tensor index of a GGUF file; GGUFFormatError if it is malformed."""
    with open(path, "rb") as f:
        # The magic first: a short file that is not GGUF at all is reported as such, in the
        # same words whichever process (gateway or worker) reads it first.
        if f.read(4) != GGUF_MAGIC:
            raise GGUFFormatError("bad magic (not a GGUF file)")
        size = f.seek(0, 2)
        if size < 24:
            raise GGUFFormatError(f"file too small for a GGUF header ({size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Cursor(buf, size))


def _parse(cur: _Cursor) -> GGUFHeader:
    if cur.take(4) != GGUF_MAGIC:
        raise GGUFFormatError("bad magic (not a GGUF file)")
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_fields = cur.scalar("<Q"), cur.scalar("<Q")
    fields: dict[str, object] = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.scalar("<I"))
    raw_infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        shape = tuple(cur.scalar("<Q") for _ in range(n_dims))
        raw_infos.append((name, shape, cur.scalar("<I"), cur.scalar("<Q")))
    alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, shape, qtype, offset in raw_infos:
        n_bytes = _n_bytes(name, shape, qtype)
        tensors.append(TensorInfo(name, shape, qtype, data_start + offset, n_bytes))
    return GGUFHeader(version, fields, tensors)


def _n_bytes(name: str, shape: tuple[int, ...], qtype: int) -> int:
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        return -1  # unknown type: the caller reports it by name
    elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return elements // block * type_size
