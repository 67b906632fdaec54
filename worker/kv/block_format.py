"""The bytes of one stored KV block: a header, the token ids, the K/V payload.

    header  magic b"RKVB", format version (u16), compression code (u8: 0 none, 1 zstd), dtype
            code (u8), the 32-byte K/V fingerprint, n_tokens (u32), stored payload length (u32),
            raw payload length (u32), CRC32 over everything before it + token ids + payload
    tokens  n_tokens little-endian int32
    payload the block's K/V (worker.engine.paged_kv.PagedKVCache.read_block), zstd-compressed or not

Nothing read back is trusted: `decode` returns the payload only when every field matches what
this store expects (fingerprint, dtype, lengths, the very token ids asked for) and the CRC holds;
otherwise it names the problem, and the store deletes the entry.
"""
from __future__ import annotations

import struct
import threading
import zlib

import zstandard

FORMAT_VERSION = 1
MAGIC = b"RKVB"
# Measured on float16 K/V-like data (184 KiB blocks): levels 1 and 3 give the same ratio
# (1.07-1.09: the mantissa bits are noise), level 1 compresses a little faster.
ZSTD_LEVEL = 1

_HEADER = struct.Struct("<4sHBB32sIIII")
_CRC_OFFSET = _HEADER.size - 4
_CRC = struct.Struct("<I")
_COMPRESSION_CODES = {"none": 0, "zstd": 1}
# q8_0 and K/V of different dtypes ("k=q8_0,v=float16": the fingerprint names the pair) since 39.
_DTYPE_CODES = {"float16": 1, "bfloat16": 2, "float32": 3, "int8": 4, "q8_0": 5, "mixed": 6}


class BlockCodec:
    def __init__(self, *, fingerprint: bytes, payload_bytes: int, dtype: str, compression: str):
        if not isinstance(fingerprint, bytes) or len(fingerprint) != 32:
            raise ValueError("fingerprint must be 32 bytes")
        if dtype not in _DTYPE_CODES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPE_CODES)}, got {dtype!r}")
        if compression not in _COMPRESSION_CODES:
            raise ValueError(f"compression must be one of {sorted(_COMPRESSION_CODES)}, got {compression!r}")
        if payload_bytes < 1:
            raise ValueError("payload_bytes must be positive")
        self._fingerprint = fingerprint
        self._payload_bytes = payload_bytes
        self._dtype_code = _DTYPE_CODES[dtype]
        self._compress = compression == "zstd"
        self._codecs = threading.local()  # zstd contexts are not safe to share between threads

    def encode(self, tokens: bytes, n_tokens: int, payload: memoryview) -> bytes:
        stored, code = payload, _COMPRESSION_CODES["none"]
        if self._compress:
            packed = self._compressor().compress(payload)
            if len(packed) < len(payload):  # incompressible data is stored raw: faster to read
                stored, code = packed, _COMPRESSION_CODES["zstd"]
        head = _HEADER.pack(MAGIC, FORMAT_VERSION, code, self._dtype_code, self._fingerprint,
                            n_tokens, len(stored), len(payload), 0)[:_CRC_OFFSET]
        crc = zlib.crc32(stored, zlib.crc32(tokens, zlib.crc32(head)))
        return b"".join((head, _CRC.pack(crc), tokens, stored))

    def header_problem(self, value: memoryview) -> str | None:
        """What makes value unusable by this store judging by its header and length, or None."""
        if len(value) < _HEADER.size:
            return f"truncated: {len(value)} bytes, shorter than the header"
        magic, version, code, dtype, fingerprint, n_tokens, stored_len, raw_len, _ = \
            _HEADER.unpack_from(value)
        if magic != MAGIC:
            return "bad magic"
        if version != FORMAT_VERSION:
            return f"unknown format version {version}"
        if fingerprint != self._fingerprint:
            return "fingerprint differs (another model or KV layout)"
        if dtype != self._dtype_code:
            return f"dtype code {dtype} differs from {self._dtype_code}"
        if raw_len != self._payload_bytes:
            return f"payload length {raw_len} differs from {self._payload_bytes}"
        if code not in _COMPRESSION_CODES.values():
            return f"unknown compression code {code}"
        if code == _COMPRESSION_CODES["none"] and stored_len != raw_len:
            return "uncompressed payload with a stored length unlike its raw length"
        if len(value) != _HEADER.size + 4 * n_tokens + stored_len:
            return f"length {len(value)} inconsistent with the header (truncated?)"
        return None

    def decode(self, value: memoryview, tokens: bytes) -> tuple[bytes | None, str | None]:
        """(payload, None) when value is a valid entry for tokens, else (None, the reason)."""
        problem = self.header_problem(value)
        if problem is not None:
            return None, problem
        _, _, code, _, _, n_tokens, _, raw_len, crc = _HEADER.unpack_from(value)
        stored_tokens = value[_HEADER.size:_HEADER.size + 4 * n_tokens]
        if stored_tokens != tokens:
            return None, "token ids differ"
        stored = value[_HEADER.size + 4 * n_tokens:]
        if zlib.crc32(stored, zlib.crc32(stored_tokens, zlib.crc32(value[:_CRC_OFFSET]))) != crc:
            return None, "checksum mismatch"
        if code == _COMPRESSION_CODES["none"]:
            return bytes(stored), None
        try:
            # The frame's own size field decides the allocation: check it before trusting it.
            if zstandard.frame_content_size(stored) != raw_len:
                return None, "compressed frame does not declare the payload length"
            payload = self._decompressor().decompress(stored)
        except zstandard.ZstdError as exc:
            return None, f"decompression failed: {exc}"
        if len(payload) != raw_len:
            return None, f"decompressed to {len(payload)} bytes, not {raw_len}"
        return payload, None

    def _compressor(self) -> zstandard.ZstdCompressor:
        if not hasattr(self._codecs, "compressor"):
            self._codecs.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        return self._codecs.compressor

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        if not hasattr(self._codecs, "decompressor"):
            self._codecs.decompressor = zstandard.ZstdDecompressor()
        return self._codecs.decompressor
