"""numba's on-disk kernel cache: where it lives, whether it may be trusted, and the threading layer
it needs.

Every entry point that runs kernels (the worker, `reame generate`/`chat`, the benchmarks, the
tests) imports `worker.engine` first, whose `__init__` calls `setup()` before any kernel module
is imported. Two faults are closed here:

- numba's cache files are pickles: a file planted in the directory runs code in whoever loads it.
  The directory is used only while nobody but its owner (this user, or root) can write into it.
- a kernel loaded from the cache that calls parallel kernels references the threading layer's
  symbols (`allocate_sched`, `do_scheduling_*`); numba starts the layer when it compiles a
  parallel kernel or loads one that was compiled in the same process, but a function compiled in
  a process that had loaded its parallel callees from the cache is saved without that note. The
  next process that loaded such a function first died with `LLVM ERROR: Symbol not found:
  allocate_sched` (or a segfault): a worker would crash-loop on a cache another entry point
  filled. Starting the layer before any kernel loads makes every cache loadable.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

log = logging.getLogger("reame.engine")

_STALE_AFTER_S = 14 * 86400

# Marks a version directory as this engine's: $NUMBA_CACHE_DIR may be shared with other numba
# projects, whose directories the clean-up below must never touch.
_OWN_MARKER = ".reame-engine-cache"

_TRUSTED_OWNERS = {os.geteuid(), 0}


class UntrustedCache(Exception):
    """The cache directory (or something in it) may have been written by another user."""


def default_base() -> Path:
    return Path(os.environ.get("REAME_NUMBA_CACHE_BASE")
                or os.environ.get("NUMBA_CACHE_DIR", "~/.cache/reame/numba")).expanduser()


def cache_dir(base: Path, digest: str) -> str:
    """The directory numba caches this engine version's kernels in: `base/digest`, private.

    `base` must be owned by this user or root and writable by no one else (a loose one of ours
    is tightened; a sticky root directory such as /tmp is accepted). `base/digest` is made
    mode 700, so nobody else can reach the files numba writes inside whatever the umask. One
    that an older version made readable by others is kept only when nothing in it is writable by
    anyone else or owned by another user; otherwise it is replaced. Where neither can be trusted
    nor replaced, kernels are compiled into a new private temporary directory (slow, but safe).
    """
    here = base / digest
    try:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_base(base)
        _check_version_dir(here)
        (here / _OWN_MARKER).touch()
        os.utime(here)
        _remove_stale(base, here)
    except UntrustedCache as exc:
        fallback = tempfile.mkdtemp(prefix=f"reame-numba-{digest}-")
        atexit.register(shutil.rmtree, fallback, True)  # nobody else would ever load it
        log.warning("numba cache %s is not safe to load (%s): compiling into %s instead, which is "
                    "slow on every start; give the cache directory to this user and `chmod go-w` it",
                    here, exc, fallback)
        return fallback
    except OSError:
        pass  # numba reports an unusable cache directory itself
    return str(here)


def _check_base(base: Path) -> None:
    info = os.lstat(base)
    if stat.S_ISLNK(info.st_mode):
        base = base.resolve()
        info = os.stat(base)
    if info.st_uid not in _TRUSTED_OWNERS:
        raise UntrustedCache(f"{base} is owned by uid {info.st_uid}")
    loose = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if not loose:
        return
    if info.st_uid == 0 and info.st_mode & stat.S_ISVTX and os.geteuid() != 0:
        return  # like /tmp: others may add entries but not touch ours; ours are checked below
    if info.st_uid != os.geteuid():
        raise UntrustedCache(f"{base} is writable by others (mode {stat.S_IMODE(info.st_mode):o})")
    os.chmod(base, stat.S_IMODE(info.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
    log.warning("numba cache %s was writable by others (mode %o): made it writable by its owner only",
                base, stat.S_IMODE(info.st_mode))


def _check_version_dir(here: Path) -> None:
    try:
        info = os.lstat(here)
    except FileNotFoundError:
        here.mkdir(mode=0o700)
        return
    if not stat.S_ISDIR(info.st_mode):  # a symlink or a file where our directory should be
        raise UntrustedCache(f"{here} is not a directory")
    if info.st_uid not in _TRUSTED_OWNERS:
        raise UntrustedCache(f"{here} is owned by uid {info.st_uid}")
    if not stat.S_IMODE(info.st_mode) & 0o077:
        return  # nobody else can reach inside, whatever the modes of what numba wrote there
    bad = _first_foreign_entry(here)
    if bad is None:  # made by an older version under umask 022: intact, so kept and made private
        os.chmod(here, 0o700)
        return
    log.warning("numba cache %s: %s; deleting its compiled kernels (they are recompiled, a minute "
                "or more) and keeping the directory private from now on", here, bad)
    try:
        shutil.rmtree(here)
        here.mkdir(mode=0o700)
    except OSError as exc:
        raise UntrustedCache(f"{bad}, and it could not be replaced: {exc}") from None


def _first_foreign_entry(root: Path) -> str | None:
    """What makes the tree under `root` untrustworthy: an entry owned by another user or writable
    by anyone but its owner (symlinks are not followed); None when there is none."""
    for directory, dirs, files in os.walk(root):
        for name in [""] + dirs + files:
            path = os.path.join(directory, name) if name else directory
            info = os.lstat(path)
            if info.st_uid not in _TRUSTED_OWNERS:
                return f"{path} is owned by uid {info.st_uid}"
            if not stat.S_ISLNK(info.st_mode) and info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return f"{path} is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _remove_stale(base: Path, here: Path) -> None:
    for old in base.iterdir():  # our versions nobody has used for two weeks
        if (old != here and (old / _OWN_MARKER).is_file()
                and time.time() - old.stat().st_mtime > _STALE_AFTER_S):
            shutil.rmtree(old, ignore_errors=True)


def start_threading_layer() -> None:
    """Start numba's thread pool now, before any kernel is loaded from the cache (module doc).
    Its size is read from NUMBA_NUM_THREADS here, once: the worker sets it before importing the
    engine; `numba.set_num_threads` still chooses how many of them a step uses."""
    from numba.np.ufunc.parallel import _launch_threads

    _launch_threads()
