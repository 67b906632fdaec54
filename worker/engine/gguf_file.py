"""Open a GGUF file (memory-mapped) and read what the engine needs, with clear errors.

Nothing here copies tensor data: `tensor()` returns the memory-mapped packed rows, and
`release_pages` drops them from the process's resident memory once the engine has packed its own
copy (a later read maps them in again from the page cache). Model
hyper-parameters come only from metadata keys (`<arch>.*`), never from the file name. The
header is parsed by shared.gguf_reader (gguf.GGUFReader took ~9 s on Gemma 3's vocabulary).
"""
from __future__ import annotations

import hashlib
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from shared.errors import ModelLoadError
from shared.gguf_reader import GGUFFormatError, read_header
from shared.model_store import record_sha256, recorded_sha256
from worker.engine.quants import spec_for

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorRef:
    name: str
    qtype: QT
    shape: tuple[int, ...]  # numpy order: (rows, cols) = (out, in) for matrices
    raw: np.ndarray  # memory-mapped packed bytes, (rows, row_bytes) for matrices


class GGUFFile:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._check_readable()
        try:
            self._header = read_header(self.path)
        except GGUFFormatError as exc:
            raise ModelLoadError(f"{self.path}: not a valid GGUF file ({exc})") from None
        self._fields = self._header.fields
        self.arch = self.get_str("general.architecture")
        self._map: mmap.mmap | None = None  # the whole file, read-only; tensors' raw arrays view it
        self.tensors = self._index_tensors()

    def _check_readable(self) -> None:
        if not self.path.exists():
            raise ModelLoadError(f"model file not found: {self.path}")
        if not self.path.is_file():
            raise ModelLoadError(f"model path is not a file: {self.path}")
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise ModelLoadError(f"cannot read model file {self.path}: {exc.strerror}") from None
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")

    def _index_tensors(self) -> dict[str, TensorRef]:
        size = self.path.stat().st_size
        data = None
        if self._header.tensors:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            data = np.frombuffer(self._map, dtype=np.uint8)
        out = {}
        for t in self._header.tensors:
            spec = spec_for(t.qtype, t.name)
            end = t.offset + t.n_bytes
            if end > size:
                raise ModelLoadError(f"{self.path}: truncated file (tensor {t.name} ends at byte {end}, file has {size})")
            shape = tuple(int(d) for d in reversed(t.shape))  # numpy order: (rows, row length)
            if shape[-1] % spec.block_size:
                raise ModelLoadError(f"{self.path}: tensor {t.name} row length {shape[-1]} is not a multiple of {spec.block_size}")
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            raw = data[t.offset:end].reshape(rows, -1)
            out[t.name] = TensorRef(t.name, QT(t.qtype), shape, raw)
        return out

    def release_pages(self) -> None:
        """Drop the mapped file's pages from this process's resident set (MADV_DONTNEED: the
        mapping stays valid; a read faults its page back in from the page cache)."""
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def mapped_address(self) -> int | None:
        """Start address of the file's mapping (to find it in /proc/self/smaps), or None."""
        if self._map is None:
            return None
        return np.frombuffer(self._map, dtype=np.uint8).ctypes.data

    # ---- metadata ----
    def has(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default=None):
        return self._fields.get(key, default)

    def get_str(self, key: str) -> str:
        value = self.get(key)
        if not isinstance(value, str):
            raise ModelLoadError(f"{self.path}: metadata key {key} missing or not a string")
        return value

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: required metadata key {key} is missing")
        return value

    def tensor(self, name: str) -> TensorRef:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelLoadError(f"{self.path}: required tensor {name} is missing") from None

    def fingerprint(self) -> str:
        """SHA-256 of the file; the K/V computed from it are only valid for these exact bytes.

        The `.sha256` sidecar (shared.model_store) saves the hash while the file is the very one
        it was computed from (size, mtime, inode, ctime); otherwise the file is hashed again and
        the sidecar rewritten.
        """
        recorded = recorded_sha256(self.path)
        if recorded is not None:
            return recorded
        hashed = self.path.stat()  # before reading: a change while hashing then shows next time
        digest = hashlib.sha256()
        with open(self.path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
        record_sha256(self.path, digest.hexdigest(), hashed)
        return digest.hexdigest()
