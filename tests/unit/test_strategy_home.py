"""Learned state belongs to a deployment (issue 37, item 1): where the strategy and kernel tables
live, the old per-user strategy ignored with a warning, a frozen strategy announced at start-up
with its age and what it pins, and `reame strategy show`."""
from __future__ import annotations

import json
import logging

from gateway.coordinator.coordinator import Coordinator
from gateway.coordinator.service import TuningService
from gateway.coordinator.store import StrategyStore
from reame.cli import main
from shared.config import Config, parse_config
from shared.knobs import Knobs
from worker.engine.tuning.kernel_table_store import table_directory

DEFAULTS = Knobs.from_config(Config())
SLOT = "host/node0/cpus0-1"
NOW = 1_000_000.0


class Pool:
    on_profile = on_register = None

    def send_strategy(self, worker_id, strategy):
        return True


def frozen_strategy(saved_hours_ago: float) -> dict:
    """A strategy pinned 6 h before NOW: max_batch_size 4, frozen."""
    coordinator = Coordinator(DEFAULTS, wall=lambda: NOW - saved_hours_ago * 3600)
    coordinator.pin({SLOT: DEFAULTS.with_(max_batch_size=4)})
    return coordinator.export()


def test_each_deployment_keeps_its_own_tuning_state(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    one = parse_config(f"[server]\nstate_dir = {tmp_path / 'one'}\n")
    two = parse_config(f"[server]\nstate_dir = {tmp_path / 'two'}\n")
    assert one.tuning_path == tmp_path / "one" / "tuning" and two.tuning_path == tmp_path / "two" / "tuning"
    assert table_directory(one) == one.tuning_path  # the kernel tables too
    explicit = parse_config(f"[server]\nstate_dir = {tmp_path / 'one'}\n[tuning]\nstate_path = {tmp_path / 'var'}\n")
    assert explicit.tuning_path == tmp_path / "var"
    assert ".cache" not in str(Config().tuning_path)  # never the per-user directory of old


def test_an_old_per_user_strategy_is_ignored_with_a_warning(tmp_path, monkeypatch, caplog):
    """The incident: a frozen one-CPU strategy in ~/.cache/reame/tuning was resumed by every server."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    old = tmp_path / "home" / ".cache" / "reame" / "tuning"
    StrategyStore(old).save(frozen_strategy(6))
    config = parse_config(f"[server]\nstate_dir = {tmp_path / 'run'}\n")
    with caplog.at_level(logging.WARNING, "reame.coordinator"):
        service = TuningService(config, Pool(), wall=lambda: NOW)
    assert not service.coordinator.frozen and service.coordinator.slots == {}
    assert f"ignoring {old / 'strategy.json'}" in caplog.text and str(tmp_path / "run" / "tuning") in caplog.text


def test_a_frozen_strategy_is_announced_with_its_age_and_pins_and_shown(tmp_path, monkeypatch, caplog, capsys):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    conf = tmp_path / "reame.conf"
    conf.write_text(f"[server]\nstate_dir = {tmp_path / 'run'}\n")
    config = parse_config(conf.read_text())
    StrategyStore(config.tuning_path).save(frozen_strategy(6))
    with caplog.at_level(logging.WARNING, "reame.coordinator"):
        service = TuningService(config, Pool(), wall=lambda: NOW)
    assert service.coordinator.frozen
    announced = [r.getMessage() for r in caplog.records if "FROZEN" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(announced) == 1
    assert "FROZEN 6.0 h ago" in announced[0] and f"{SLOT}: v1: max_batch_size=4 (default 8)" in announced[0]

    assert main(["--config", str(conf), "strategy", "show"]) == 0
    out = capsys.readouterr().out
    assert str(config.tuning_path / "strategy.json") in out
    assert "FROZEN" in out and "max_batch_size=4 (default 8)" in out


def test_strategy_show_names_the_cause_of_a_placement_and_an_ignored_old_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    conf = tmp_path / "reame.conf"
    conf.write_text("[tuning]\nstate_path = state\n")
    assert main(["--config", str(conf), "strategy", "show"]) == 0
    assert "no saved strategy in" in capsys.readouterr().out
    doc = frozen_strategy(1)
    doc["workers"][SLOT]["knobs"]["cpus"] = [0]
    doc["workers"][SLOT]["cause"] = {"policy": "busy CPUs", "reason": "other processes used 50% of CPU 1",
                                     "cpus": [1], "at": NOW}
    StrategyStore(tmp_path / "state").save(doc)
    StrategyStore(tmp_path / "home" / ".cache" / "reame" / "tuning").save({"version": 3})
    assert main(["--config", str(conf), "strategy", "show"]) == 0
    out = capsys.readouterr().out
    assert "cpus=0 (default all)" in out and "because other processes used 50% of CPU 1" in out
    assert "not resumed at start" in out and "ignored:" in out and json.loads((tmp_path / "state" / "strategy.json")
                                                                               .read_text())["frozen"]


def test_through_a_gateway_a_hog_freeze_and_restart_end_on_both_cpus(tmp_path):
    """The incident end to end in one process: a real gateway (its TuningService, store and
    /admin routes) with a fake worker over ZeroMQ. The hog moves the worker to CPU 0, the operator
    freezes, the gateway and the worker restart without the hog: the worker runs on both CPUs."""
    import asyncio

    import requests

    from tests.unit.test_coordinator_causes import GONE, HOG, profile
    from tests.unit.test_tuning_gateway import KEY, WORKER, add_tuned_worker, make_server

    server = make_server(tmp_path)
    slot = "h/node0/cpus0-1"

    def send(n: int, worker: str, running, **fields) -> None:
        """Profiles as the worker's pulse sends them: with the version its TuningState runs."""
        for _ in range(n):
            p = profile(worker, knobs_version=running.version, **fields)
            asyncio.run_coroutine_threadsafe(_call(server.state.tuning.on_profile, p), server.loop).result(5)

    try:
        tuning = add_tuned_worker(server, WORKER)
        send(2, WORKER, tuning, **HOG)
        server.wait_until(lambda: tuning.version == 1)
        send(4, WORKER, tuning, **HOG, output_tokens=2500)  # measured: it helped while the hog ran
        assert requests.post(server.url + "/admin/strategy/freeze", headers=KEY, timeout=5).status_code == 200
        saved = json.loads((tmp_path / "tuning" / "strategy.json").read_text())
        assert saved["frozen"] and saved["workers"][slot]["knobs"]["cpus"] == [0]

        server.restart_gateway()
        fresh = add_tuned_worker(server, "h/node0/2")
        strategy = requests.get(server.url + "/admin/strategy", headers=KEY, timeout=5).json()
        assert strategy["frozen"] and strategy["workers"][slot]["knobs"]["cpus"] == []
        send(1, "h/node0/2", fresh, **GONE)  # its first profile: it is sent what its slot should run
        version = server.state.tuning.coordinator.slots[slot].version
        server.wait_until(lambda: fresh.version == version)
        send(6, "h/node0/2", fresh, **GONE)
        assert server.state.tuning.coordinator.slots[slot].knobs.cpus == () and fresh.version == version
    finally:
        server.close()


async def _call(fn, *args):
    return fn(*args)
