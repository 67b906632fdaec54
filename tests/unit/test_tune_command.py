"""`reame tune show` / `reame tune reset` on a state_path holding saved kernel tables."""
from __future__ import annotations

from reame.cli import main
from worker.engine.tuning.kernel_table_store import KernelTableStore, saved_tables


def _config(tmp_path):
    conf = tmp_path / "reame.conf"
    conf.write_text("[tuning]\nstate_path = state\n")
    return str(conf)


def test_show_prints_each_table_and_reset_clears_them(tmp_path, capsys):
    conf = _config(tmp_path)
    assert main(["--config", conf, "tune", "show"]) == 0
    assert "no kernel tables" in capsys.readouterr().out
    parts = {"cpu": "AMD EPYC 7R13", "cpu_flags": "f1", "model_sha256": "ab" * 32, "reame": "0.1.0",
             "engine_code": "e1", "numerics": "int8", "threads": "2"}
    KernelTableStore(tmp_path / "state", parts).save({"1": ("int8_serial", 1), "2-8": ("int8", 2)})
    assert main(["--config", conf, "tune", "show"]) == 0
    out = capsys.readouterr().out
    assert "AMD EPYC 7R13" in out and "int8_serial" in out and "2-8" in out
    assert main(["--config", conf, "tune", "reset"]) == 0
    assert "removed 1" in capsys.readouterr().out
    assert saved_tables(tmp_path / "state") == []
