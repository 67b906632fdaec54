"""Directories of state only Reame's own user may read or write: learned kernel tables, the
coordinator's strategy, the host's prefix store.

A directory made by an older version, or under a loose umask (002 makes it group-writable), kept
its mode: other users could read cached prompts or rewrite the strategy every worker follows. At
start-up each such directory is made owner-only (700, its files 600), and each change is logged.
One that belongs to another user cannot be fixed from here: start-up is refused, naming it.
"""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from shared.errors import ConfigError

_OWNER_ONLY_DIR = 0o700
_OWNER_ONLY_FILE = 0o600


def make_private(directory: Path, what: str, log: logging.Logger) -> None:
    """Create `directory` owner-only, or make an existing one (and the files directly in it) so.

    ConfigError when it, or a file in it, belongs to another user than this one or root. OSError
    as the file system raises it (callers that can run without the state catch it)."""
    directory = Path(directory)
    directory.mkdir(mode=_OWNER_ONLY_DIR, parents=True, exist_ok=True)
    _tighten(directory, os.stat(directory), _OWNER_ONLY_DIR, what, log)
    for entry in directory.iterdir():
        info = os.lstat(entry)
        if stat.S_ISREG(info.st_mode):
            _tighten(entry, info, _OWNER_ONLY_FILE, what, log)


def _tighten(path: Path, info: os.stat_result, private: int, what: str, log: logging.Logger) -> None:
    if info.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"{what}: {path} belongs to uid {info.st_uid}, not to this user ({os.geteuid()}): "
                          "other users must not write the state Reame trusts; chown it to this user")
    mode = stat.S_IMODE(info.st_mode)
    if not mode & 0o077:
        return
    os.chmod(path, mode & private)
    log.warning("%s: %s was open to other users (mode %o, left by an older version or a loose umask): "
                "made it mode %o", what, path, mode, mode & private)


def check_secret_file(path: Path, what: str, log: logging.Logger) -> None:
    """A file of secrets (API keys) must be readable by no one but its owner and group, and
    writable by its owner only. One of ours is fixed (logged); one of root's that is not is
    refused, as is another user's: ConfigError naming the fix. A missing file is left to the
    caller's read to report."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    if info.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"{what}: {path} belongs to uid {info.st_uid}, not to this user ({os.geteuid()}) "
                          "or root: another user could change the keys; chown it")
    mode = stat.S_IMODE(info.st_mode)
    loose = mode & (stat.S_IRWXO | stat.S_IWGRP)
    if not loose:
        return
    if info.st_uid != os.geteuid():
        raise ConfigError(f"{what}: {path} is open to other users (mode {mode:o}): `chmod o-rwx,g-w` it")
    os.chmod(path, mode & ~(stat.S_IRWXO | stat.S_IWGRP))
    log.warning("%s: %s was open to other users (mode %o, left by an older version or a loose umask): "
                "made it mode %o; keys other users could read should be replaced", what, path, mode,
                mode & ~(stat.S_IRWXO | stat.S_IWGRP))
