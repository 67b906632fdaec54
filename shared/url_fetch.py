"""Download one file over HTTP(S) into a folder: streamed, resumable, verified, placed atomically.

The bytes go to `.<name>.<url-hash>.partial` beside the final file. A dropped connection is
retried with an HTTP Range request from the bytes already on disk, and the partial file survives
a killed process, so the next `reame models pull URL` resumes it too. A server that ignores Range
(answers 200 instead of 206) restarts the transfer from zero. The file takes its final name only
after its SHA-256 matched the expected one (when one is given) and it starts with the GGUF magic;
a mismatch deletes the partial file, so a bad download never leaves anything behind.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable

from shared.errors import ModelFetchError

Progress = Callable[[str], object]

_CHUNK = 1 << 20
_ATTEMPTS = 5  # connections per pull: the first one plus four resumptions
_CONNECT_TIMEOUT_S = 20.0  # also the longest a stalled read may wait before we reconnect
_GGUF_MAGIC = b"GGUF"


def file_name_of(url: str) -> str:
    """The file name a URL names: its path's last segment (`?download=true` and the like dropped)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ModelFetchError(f"not an http(s) URL: {url}")
    name = urllib.parse.unquote(parsed.path.rsplit("/", 1)[-1])
    if not name or name in (".", "..") or "/" in name or not name.endswith(".gguf"):
        raise ModelFetchError(f"the URL must name a .gguf file (got {name or 'no file name'!r}): {url}")
    return name


def is_url(reference: str) -> bool:
    return reference.startswith(("https://", "http://"))


def fetch(url: str, dest: Path, sha256: str | None, progress: Progress, label: str) -> str:
    """Download url to dest (a path in an existing folder); returns the file's SHA-256.

    Raises ModelFetchError on a transfer that cannot complete (the partial file is kept for a
    later resume) or on a checksum or format mismatch (the partial file is deleted).
    """
    expected = sha256.lower() if sha256 else None
    if expected is not None and not re.fullmatch(r"[0-9a-f]{64}", expected):
        raise ModelFetchError(f"--sha256 must be 64 hex digits, got {sha256!r}")
    url_tag = hashlib.sha256(url.encode()).hexdigest()[:12]
    partial = dest.with_name(f".{dest.name}.{url_tag}.partial")
    last_error = ""
    for attempt in range(_ATTEMPTS):
        if attempt:
            time.sleep(min(2.0 ** attempt, 10.0) * 0.1)
        try:
            if _transfer(url, partial, progress, label):
                break
        except _Retryable as exc:
            last_error = str(exc)
            progress(f"{label}: {exc}; resuming from {_mb(_size(partial))}")
    else:
        raise ModelFetchError(f"{label}: download did not complete after {_ATTEMPTS} attempts "
                              f"({last_error}); {_mb(_size(partial))} kept in {partial}, run the pull again to resume")
    digest = _hash_file(partial)
    with open(partial, "rb") as head:
        magic = head.read(4)
    if expected is not None and digest != expected:
        partial.unlink(missing_ok=True)
        raise ModelFetchError(f"{label}: sha256 mismatch: expected {expected}, got {digest}; nothing was kept")
    if magic != _GGUF_MAGIC:
        partial.unlink(missing_ok=True)
        raise ModelFetchError(f"{label}: the downloaded file is not GGUF (starts with {magic!r}); nothing was kept")
    os.chmod(partial, 0o644)
    os.replace(partial, dest)
    return digest


class _Retryable(Exception):
    """A transfer that broke off in a way a new connection may mend."""


def _transfer(url: str, partial: Path, progress: Progress, label: str) -> bool:
    """One connection: append to partial from its current size. True when the file is complete."""
    have = _size(partial)
    request = urllib.request.Request(url, headers={"User-Agent": "reame-models-pull"})
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        response = urllib.request.urlopen(request, timeout=_CONNECT_TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # nothing past what we have: the partial file is whole
            return True
        if exc.code in (408, 429) or exc.code >= 500:
            raise _Retryable(f"HTTP {exc.code} {exc.reason}") from None
        raise ModelFetchError(f"{label}: HTTP {exc.code} {exc.reason} for {url}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if not have:
            # Nothing arrived yet: a host that cannot be reached is not worth four more tries.
            raise ModelFetchError(f"{label}: cannot reach {url}: {reason}") from None
        raise _Retryable(f"connection failed: {reason}") from None
    with response:
        if have and response.status == 200:
            progress(f"{label}: the server ignored the range request; starting again from zero")
            have = 0
        elif have and response.status != 206:
            raise ModelFetchError(f"{label}: unexpected HTTP {response.status} to a range request")
        length = response.headers.get("Content-Length")
        total = have + int(length) if length and length.isdigit() else None
        meter = _Meter(progress, label, total, have)
        with open(partial, "ab" if have else "wb") as out:
            while True:
                try:
                    chunk = response.read(_CHUNK)
                except (OSError, http.client.HTTPException):  # a reset, a timeout, an IncompleteRead
                    out.flush()
                    raise _Retryable(f"connection lost after {_mb(_size(partial))}") from None
                if not chunk:
                    break
                try:
                    out.write(chunk)
                except OSError as exc:
                    raise ModelFetchError(f"{label}: cannot write {partial}: {exc.strerror}") from None
                meter.add(len(chunk))
    if total is not None and _size(partial) < total:
        raise _Retryable(f"connection closed at {_mb(_size(partial))} of {_mb(total)}")
    return True


class _Meter:
    """Progress in 5% steps (or every 50 MB when the size is unknown)."""

    def __init__(self, progress: Progress, label: str, total: int | None, done: int):
        self.progress, self.label, self.total, self.done = progress, label, total, done
        self.step = max(total // 20, 1) if total else 50_000_000
        self.next_mark = (done // self.step + 1) * self.step

    def add(self, n: int) -> None:
        self.done += n
        if self.done >= self.next_mark:
            self.next_mark = (self.done // self.step + 1) * self.step
            of = f" / {_mb(self.total)} ({100 * self.done / self.total:3.0f}%)" if self.total else ""
            self.progress(f"{self.label}: {_mb(self.done)}{of}")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _mb(n: int | None) -> str:
    return f"{(n or 0) / 1e6:.1f} MB"


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as src:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
