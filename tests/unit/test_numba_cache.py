"""The engine's numba cache: one directory per engine source version, and only its own are cleaned."""
from __future__ import annotations

import os
import time

from worker.engine import SOURCE_DIGEST, _numba_cache_dir

OLD = time.time() - 30 * 86400


def aged(path, marker: bool = False):
    path.mkdir()
    (path / "kernel.nbi").write_bytes(b"x")
    if marker:
        (path / ".reame-engine-cache").touch()
    os.utime(path, (OLD, OLD))
    return path


def test_only_this_engines_stale_versions_are_deleted(tmp_path):
    # $NUMBA_CACHE_DIR may be shared: another project's old directory must survive our clean-up.
    theirs = aged(tmp_path / "other-project")
    theirs_hex = aged(tmp_path / "0123456789abcdef")  # even one named like ours
    ours_old = aged(tmp_path / "fedcba9876543210", marker=True)
    here = _numba_cache_dir(tmp_path)
    assert here == str(tmp_path / SOURCE_DIGEST)
    assert (tmp_path / SOURCE_DIGEST / ".reame-engine-cache").is_file()
    assert theirs.is_dir() and theirs_hex.is_dir()
    assert not ours_old.exists()


def test_a_recent_version_of_ours_is_kept(tmp_path):
    recent = tmp_path / "fedcba9876543210"
    recent.mkdir()
    (recent / ".reame-engine-cache").touch()
    _numba_cache_dir(tmp_path)
    assert recent.is_dir()
