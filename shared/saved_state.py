"""Learned state, saved: one format for all of it (the coordinator's strategy, the kernel tables,
the speculator's state in the n-gram archive).

A saved state is one JSON object: the state's own fields beside three of the format's,
  "format"          its kind, e.g. "reame.kernel_table"
  "format_version"  the kind's version: a reader takes only the one it knows
  "format_crc32"    CRC32 of the state's fields as canonical JSON (sorted keys, no spaces)
so it stays readable with any JSON tool (`reame tune show`, `reame strategy show`), and a damaged
save, another kind or another version is never taken for state: `decode` returns None and the
caller starts fresh. Files are replaced atomically (a reader or a crash sees the old file or the
new one, never half of one) and are owner-only.
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

FORMAT_FIELDS = ("format", "format_version", "format_crc32")


def encode(kind: str, version: int, state: dict[str, Any], indent: int | None = None) -> bytes:
    """state with the format's fields, as UTF-8 JSON."""
    clash = [name for name in FORMAT_FIELDS if name in state]
    if clash:
        raise ValueError(f"a saved state may not have a field named {clash[0]!r}")
    doc = {"format": kind, "format_version": version, "format_crc32": _crc(state), **state}
    return json.dumps(doc, indent=indent).encode()


def decode(data: bytes | str | None, kind: str, version: int) -> dict[str, Any] | None:
    """The state's fields, or None when data is absent, not JSON, of another kind or version, or damaged."""
    doc = parse(data)
    if doc is None or doc.get("format") != kind or doc.get("format_version") != version:
        return None
    crc = doc.pop("format_crc32", None)
    del doc["format"], doc["format_version"]
    return doc if crc == _crc(doc) else None


def parse(data: bytes | str | None) -> dict[str, Any] | None:
    """The JSON object in data as it stands (format fields included, nothing checked), or None."""
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except ValueError:  # UnicodeDecodeError too
        return None
    return doc if isinstance(doc, dict) else None


def write_file(path: Path, data: bytes) -> None:
    """Replaces path with data atomically, the file 600 in a 700 directory; OSError as raised."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")  # workers may save the same file at once
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # one a crash left behind keeps its old mode otherwise
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # a crash after the rename must not leave an empty file
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _crc(state: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(state, sort_keys=True, separators=(",", ":")).encode())
