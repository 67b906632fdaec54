"""shared.logs: Reame's debug level does not turn on the libraries' internals."""
from __future__ import annotations

import logging

from shared.config import load_config
from shared.logs import setup_logging


def test_debug_level_keeps_numba_compiler_logs_off():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("debug", "test")
        assert logging.getLogger("reame.worker").isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("numba.core.ssa").isEnabledFor(logging.DEBUG)
        assert logging.getLogger("numba").isEnabledFor(logging.WARNING)
        setup_logging("error", "test")
        assert not logging.getLogger("numba").isEnabledFor(logging.WARNING)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        logging.getLogger("numba").setLevel(logging.NOTSET)


def started(capsys) -> str:
    """What setup_logging writes at a process's start-up."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("info", "test")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    return capsys.readouterr().err


def test_start_up_names_the_config_file_found_in_the_working_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REAME_CONFIG", raising=False)
    (tmp_path / "reame.conf").write_text("[gateway]\nport = 8123\n")
    assert load_config().gateway.port == 8123
    assert f"config: {tmp_path / 'reame.conf'} (found in the working directory {tmp_path})" in started(capsys)


def test_start_up_says_how_the_config_was_chosen(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    named = tmp_path / "named.conf"
    named.write_text("")
    monkeypatch.setenv("REAME_CONFIG", str(named))
    load_config()
    assert f"config: {named} (named by $REAME_CONFIG)" in started(capsys)
    load_config(named)
    assert f"config: {named} (named by --config)" in started(capsys)
    monkeypatch.delenv("REAME_CONFIG")
    load_config()
    assert "config: no reame.conf in the working directory" in started(capsys)
