"""The knobs a coordinator sets on a worker have one declaration (shared.knobs): the gateway, the
wire and the worker read the same fields, defaults and bounds; "twice the start batch" is one
rule; and every knob a Strategy carries is one the worker runs (the thread count is not a knob:
the worker's kernel tuner decides it)."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import get_type_hints

import orjson
import pytest

from gateway.coordinator import policy
from shared import knobs as knobs_module
from shared import protocol
from shared.config import Config
from shared.errors import ConfigError
from shared.knobs import Knobs, SchedulerKnobs, batch_ceiling
from shared.protocol import Strategy
from tests.fakes import FakeGenerator
from tests.unit.test_coordinator import SHORT, profile
from tests.unit.test_worker_service import INFO, ScriptedSocket
from worker.sched import tuning_state
from worker.sched.tuning_state import TuningState
from worker.service import WorkerService

REPO = Path(__file__).resolve().parents[2]
SCHEDULER_KNOBS = [f.name for f in dataclasses.fields(SchedulerKnobs)]
STARTED = Knobs.from_config(Config())  # 8 sequences, budget 512, chunk 512, attention 512, window 2 ms


def test_the_gateway_the_wire_and_the_worker_share_one_declaration():
    assert tuning_state.SchedulerKnobs is SchedulerKnobs and issubclass(Knobs, SchedulerKnobs)
    assert get_type_hints(Strategy)["knobs"] is Knobs
    assert Knobs.from_config(Config()).scheduler == SchedulerKnobs.from_config(Config()) == SchedulerKnobs()
    # No other class of the product code declares a knob as a field (shared.config reads reame.conf).
    declared_elsewhere = []
    for path in [*REPO.glob("gateway/**/*.py"), *REPO.glob("worker/**/*.py"), *REPO.glob("shared/*.py")]:
        if path.name in ("knobs.py", "config.py") and path.parent.name == "shared":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                declared_elsewhere += [f"{path.relative_to(REPO)}:{node.name}.{item.target.id}"
                                       for item in node.body if isinstance(item, ast.AnnAssign)
                                       and isinstance(item.target, ast.Name) and item.target.id in SCHEDULER_KNOBS]
    assert declared_elsewhere == []


def _frame_with(name: str, value) -> bytes:
    """A Strategy frame whose knob `name` is `value`, whatever the encoder would allow."""
    frame = protocol.encode(Strategy(1, "test", Knobs()))
    body = orjson.loads(frame[1:])
    body["knobs"][name] = value
    return frame[:1] + orjson.dumps(body)


@pytest.mark.parametrize("name", SCHEDULER_KNOBS)
def test_every_reader_keeps_to_the_declared_bounds(name):
    """A frame, a saved or imported strategy and the worker's knobs refuse the same values."""
    meta = {f.name: f.metadata for f in dataclasses.fields(SchedulerKnobs)}[name]
    step = 1 if isinstance(meta["low"], int) else 0.5
    for bad in (meta["low"] - step, meta["high"] + step, True, "8"):
        with pytest.raises(protocol.ProtocolError, match=f"Strategy\\.knobs(\\.|: ){name}"):
            protocol.decode(_frame_with(name, bad))
        with pytest.raises(ConfigError, match=f"strategy workers\\['s'\\].{name}"):
            Knobs.from_dict({**STARTED.as_dict(), name: bad}, "strategy workers['s']")
        with pytest.raises(ConfigError, match=name):
            SchedulerKnobs(**{name: bad})
    for edge in (meta["low"], meta["high"]):
        assert getattr(protocol.decode(_frame_with(name, edge)).knobs, name) == edge
        assert getattr(Knobs.from_dict({**STARTED.as_dict(), name: edge}), name) == edge
        assert getattr(SchedulerKnobs(**{name: edge}), name) == edge


def test_a_strategy_saved_with_a_thread_count_still_loads_without_it():
    saved = {**STARTED.as_dict(), "threads": 1}
    assert Knobs.from_dict(saved) == STARTED
    with pytest.raises(ConfigError, match="unknown knobs \\['thread'\\]"):
        Knobs.from_dict({**STARTED.as_dict(), "thread": 1})


def test_a_strategy_saved_before_decode_share_loads_with_reame_confs_share():
    saved = {k: v for k, v in STARTED.as_dict().items() if k != "decode_share"}
    assert Knobs.from_dict(saved) == STARTED and STARTED.decode_share == 0.0
    with pytest.raises(ConfigError, match="missing knobs \\['prefill_chunk'\\]"):
        Knobs.from_dict({k: v for k, v in STARTED.as_dict().items() if k != "prefill_chunk"})
    # An import keeps to what the policies would choose: a share of 8 all but stops new prompts.
    with pytest.raises(ConfigError, match="decode_share: at most 1"):
        STARTED.with_(decode_share=8.0).check_within(STARTED)
    STARTED.with_(decode_share=policy.MAX_DECODE_SHARE).check_within(STARTED)


def test_twice_the_start_batch_is_one_rule_for_the_coordinator_and_the_worker(monkeypatch):
    """Change the growth once and every reader follows: the policies, an import's bounds, and the
    worker that checks a Strategy against what its engine was sized for."""
    monkeypatch.setattr(knobs_module, "MAX_BATCH_GROWTH", 3)
    assert batch_ceiling(8) == 24
    [grown] = policy.propose(profile(**{**SHORT, "batch_size_mean": 15.0}), STARTED.with_(max_batch_size=16), STARTED)
    assert grown.knobs.max_batch_size == 24  # doubling from 16, capped at the ceiling
    STARTED.with_(max_batch_size=24, token_budget=536).check_within(STARTED)
    with pytest.raises(ConfigError, match="max_batch_size: at most 24"):
        STARTED.with_(max_batch_size=25, token_budget=536).check_within(STARTED)
    tuning = TuningState(STARTED.scheduler)
    service = WorkerService(FakeGenerator(), ScriptedSocket(), INFO, tuning=tuning)
    service._handle(Strategy(1, "grow", STARTED.with_(max_batch_size=24, token_budget=536)))
    service._handle(Strategy(2, "too many", STARTED.with_(max_batch_size=25, token_budget=536)))
    assert tuning.version == 1 and tuning.current().max_batch_size == 24


class RecordingPlacement:
    """worker.placement.Placement's face to the serve loop, without moving any thread."""

    def __init__(self, cpus: list[int]):
        self.cpus, self.in_use, self.bound, self.node = list(cpus), list(cpus), False, 0

    def apply(self, cpus: list[int], bind_memory: bool) -> bool:
        before = (self.in_use, self.bound)
        self.in_use, self.bound = sorted(cpus) if cpus else list(self.cpus), bind_memory
        return before != (self.in_use, self.bound)


def test_what_the_coordinator_records_is_what_the_worker_runs():
    """Every knob of a Strategy lands in the worker: a knob the worker would drop (as it dropped
    the coordinator's thread count while the coordinator recorded and measured it) fails here."""
    sent = Knobs(max_batch_size=16, token_budget=600, prefill_chunk=256, attention_chunk=128,
                 batching_window_ms=4.0, decode_share=0.5, cpus=(1,), bind_memory=True)
    assert all(getattr(sent, f.name) != f.default for f in dataclasses.fields(Knobs))
    tuning, placement = TuningState(STARTED.scheduler), RecordingPlacement([0, 1])
    service = WorkerService(FakeGenerator(), ScriptedSocket(), INFO, tuning=tuning, placement=placement)
    service._handle(protocol.decode(protocol.encode(Strategy(1, "all of them", sent))))
    running = {**tuning.current().as_dict(), "cpus": tuple(placement.in_use), "bind_memory": placement.bound}
    assert running == sent.as_dict()
