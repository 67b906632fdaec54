"""`reame strategy export|import FILE` against a live (fake-worker) gateway."""
from __future__ import annotations

import json

from reame.cli import main
from tests.unit.test_tuning_gateway import KEY, WORKER, add_tuned_worker, feed, make_server
from worker.sched.tuning_state import SchedulerKnobs


def test_export_then_import_pins_the_strategy(tmp_path, capsys):
    server = make_server(tmp_path)
    try:
        tuning = add_tuned_worker(server, WORKER)
        feed(server, 1)
        path = tmp_path / "strategy.json"
        assert main(["strategy", "export", str(path), "--url", server.url, "--api-key", "k"]) == 0
        doc = json.loads(path.read_text())
        assert doc["version"] == 0 and doc["frozen"] is False and doc["defaults"] == {**SchedulerKnobs().as_dict(), "cpus": [], "bind_memory": False}
        doc["workers"] = {"*": {"knobs": {**doc["defaults"], "batching_window_ms": 0.5}}}
        path.write_text(json.dumps(doc))
        assert main(["strategy", "import", str(path), "--url", server.url, "--api-key", "k"]) == 0
        server.wait_until(lambda: tuning.current().batching_window_ms == 0.5)
        assert "in force (frozen)" in capsys.readouterr().out
        assert main(["strategy", "export", str(path), "--url", server.url]) == 1  # no key
        assert "401" in capsys.readouterr().err
    finally:
        server.close()
