"""The command-line pieces every Reame process shares (shared/command_line.py)."""
from __future__ import annotations

import argparse

from shared.command_line import add_common_flags, load_with_common_flags, run_process
from shared.errors import ConfigError


def test_a_start_up_error_is_one_line_and_status_1_not_a_traceback(capsys):
    def start():
        raise ConfigError("[engine] kv_block_size must be at least 1, got 0")

    assert run_process("reame-worker", start) == 1
    assert capsys.readouterr().err == "reame-worker: error: [engine] kv_block_size must be at least 1, got 0\n"


def test_ctrl_c_is_status_130_and_a_clean_run_0():
    def interrupted():
        raise KeyboardInterrupt

    assert run_process("reame-gateway", interrupted) == 130
    assert run_process("reame-gateway", lambda: None) == 0
    assert run_process("reame", lambda: 2) == 2  # a command's own status (`reame models pull NAME --sha256`: 2)


def test_the_common_flags_land_in_their_sections(tmp_path, monkeypatch):
    conf = tmp_path / "reame.conf"
    conf.write_text("[tuning]\nadaptive = true\n")
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    add_common_flags(parser)
    args = parser.parse_args(["--config", str(conf), "--model", "m.gguf", "--state-dir", "run", "--adaptive", "off"])
    config = load_with_common_flags(args)
    assert config.model.model_path == str(tmp_path / "m.gguf")
    assert config.server.state_dir == str(tmp_path / "run")
    assert config.tuning.adaptive is False
    assert load_with_common_flags(parser.parse_args(["--config", str(conf)])).tuning.adaptive is True
