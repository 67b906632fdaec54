"""The engine's numba cache: one directory per engine source version, and only its own are cleaned."""
from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import pytest

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


# ---- whether the cache may be loaded: numba's cache files are pickles (issue 41.8) -------------

def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_new_cache_is_private_under_a_loose_umask(tmp_path):
    old = os.umask(0o002)
    try:
        here = Path(_numba_cache_dir(tmp_path / "numba"))
    finally:
        os.umask(old)
    assert mode(here) == 0o700  # numba's own files inside are out of everyone else's reach
    assert mode(tmp_path / "numba") & 0o022 == 0


def test_a_base_directory_writable_by_others_is_tightened_with_a_log_line(tmp_path, caplog):
    base = tmp_path / "numba"
    base.mkdir()
    base.chmod(0o777)
    with caplog.at_level(logging.WARNING, "reame.engine"):
        here = _numba_cache_dir(base)
    assert here == str(base / SOURCE_DIGEST)
    assert mode(base) == 0o755
    assert "writable by others (mode 777)" in caplog.text


def test_an_intact_cache_of_an_older_version_is_kept_and_made_private(tmp_path, caplog):
    here = tmp_path / SOURCE_DIGEST
    (here / "sub").mkdir(parents=True, mode=0o755)
    here.chmod(0o755)  # as mkdir made it under umask 022
    (here / "sub" / "kernel.nbi").write_bytes(b"compiled")
    (here / "sub" / "kernel.nbi").chmod(0o644)
    with caplog.at_level(logging.WARNING, "reame.engine"):
        assert _numba_cache_dir(tmp_path) == str(here)
    assert (here / "sub" / "kernel.nbi").read_bytes() == b"compiled"
    assert mode(here) == 0o700
    assert caplog.text == ""


def test_a_cache_with_a_file_others_could_write_is_replaced(tmp_path, caplog):
    here = tmp_path / SOURCE_DIGEST
    (here / "sub").mkdir(parents=True)
    here.chmod(0o755)
    planted = here / "sub" / "kernel.nbi"
    planted.write_bytes(b"a pickle that runs code")
    planted.chmod(0o666)
    with caplog.at_level(logging.WARNING, "reame.engine"):
        assert _numba_cache_dir(tmp_path) == str(here)
    assert not planted.exists()
    assert mode(here) == 0o700
    assert f"{planted} is writable by others (mode 666)" in caplog.text


def test_a_symlink_in_place_of_the_cache_is_not_followed(tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "numba").mkdir(mode=0o700)
    (tmp_path / "numba" / SOURCE_DIGEST).symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, "reame.engine"):
        here = _numba_cache_dir(tmp_path / "numba")
    assert not here.startswith(str(tmp_path))
    assert mode(here) == 0o700 and os.listdir(here) == []
    assert "is not a directory" in caplog.text and "compiling into" in caplog.text
    os.rmdir(here)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file owned by another user needs root")


@needs_root
def test_a_cache_owned_by_another_user_is_not_loaded(tmp_path, caplog):
    base = tmp_path / "numba"
    (base / SOURCE_DIGEST).mkdir(parents=True, mode=0o700)
    (base / SOURCE_DIGEST / "kernel.nbi").write_bytes(b"theirs")
    os.chown(base / SOURCE_DIGEST, 65534, 65534)
    with caplog.at_level(logging.WARNING, "reame.engine"):
        here = _numba_cache_dir(base)
    assert here != str(base / SOURCE_DIGEST) and os.listdir(here) == []
    assert "is owned by uid 65534" in caplog.text
    os.rmdir(here)


@needs_root
def test_a_file_another_user_planted_in_an_open_cache_is_removed(tmp_path):
    here = tmp_path / SOURCE_DIGEST
    here.mkdir(mode=0o755)
    here.chmod(0o755)
    planted = here / "kernel.nbi"
    planted.write_bytes(b"theirs")
    planted.chmod(0o644)
    os.chown(planted, 65534, 65534)
    assert _numba_cache_dir(tmp_path) == str(here)
    assert not planted.exists() and mode(here) == 0o700


@needs_root
def test_a_base_directory_owned_by_another_user_is_not_used(tmp_path, caplog):
    base = tmp_path / "numba"
    base.mkdir(mode=0o755)
    os.chown(base, 65534, 65534)
    with caplog.at_level(logging.WARNING, "reame.engine"):
        here = _numba_cache_dir(base)
    assert not here.startswith(str(base))
    assert f"{base} is owned by uid 65534" in caplog.text
    os.rmdir(here)
