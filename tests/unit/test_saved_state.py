"""Learned state's one format (shared.saved_state): a round trip, a changed value or another kind
or version is no state, files are replaced whole and owner-only; the strategy, the kernel tables
and the speculator's state all use it, and a strategy.json of an older version is still read."""
from __future__ import annotations

import json
import stat

import pytest

from gateway.coordinator.store import StrategyStore
from shared import saved_state
from worker.engine.tuning.kernel_table_store import KernelTableStore
from worker.speculative import learned

STATE = {"choices": {"1": ["int8", 2]}, "rate": 0.1 + 0.2, "name": "caf\u00e9"}


def test_a_round_trip_gives_the_state_back_and_the_file_is_readable_json():
    blob = saved_state.encode("reame.test", 4, STATE, indent=1)
    assert saved_state.decode(blob, "reame.test", 4) == STATE
    doc = json.loads(blob)
    assert doc["format"] == "reame.test" and doc["format_version"] == 4 and doc["choices"] == STATE["choices"]


@pytest.mark.parametrize("change", [
    lambda doc: doc["choices"]["1"].__setitem__(1, 1),  # valid JSON, another value: the CRC says so
    lambda doc: doc.__setitem__("extra", 1),
    lambda doc: doc.__setitem__("format_version", 3),
    lambda doc: doc.__setitem__("format", "reame.other"),
    lambda doc: doc.pop("format_crc32"),
])
def test_a_changed_save_or_another_kind_or_version_is_no_state(change):
    doc = json.loads(saved_state.encode("reame.test", 4, STATE))
    change(doc)
    assert saved_state.decode(json.dumps(doc), "reame.test", 4) is None


def test_what_is_not_a_json_object_is_no_state():
    for data in (None, b"", b"{not json", b"[1, 2]", b"\xff\xfe", "null"):
        assert saved_state.decode(data, "reame.test", 4) is None


def test_a_state_may_not_use_the_format_fields():
    with pytest.raises(ValueError, match="format_version"):
        saved_state.encode("reame.test", 1, {"format_version": 2})


def test_a_file_is_replaced_whole_owner_only_with_no_temporary_left(tmp_path):
    path = tmp_path / "state" / "x.json"
    saved_state.write_file(path, b"old")
    path.chmod(0o644)
    saved_state.write_file(path, b"new")
    assert path.read_bytes() == b"new" and [p.name for p in path.parent.iterdir()] == ["x.json"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_the_three_kinds_of_learned_state_are_saved_in_the_format(tmp_path):
    StrategyStore(tmp_path).save({"version": 2, "frozen": True})
    KernelTableStore(tmp_path, {"cpu": "x"}).save({"1": ("int8", 2)})
    kinds = {json.loads(p.read_text())["format"] for p in tmp_path.iterdir()}
    assert kinds == {"reame.strategy", "reame.kernel_table"}
    assert json.loads(learned.encode(learned.LearnedState()))["format"] == "reame.speculator"


def test_a_damaged_kernel_table_starts_fresh_with_a_warning(tmp_path, caplog):
    store = KernelTableStore(tmp_path, {"cpu": "x"})
    store.save({"1": ("int8", 2)})
    assert store.load() == {"1": ["int8", 2]}
    store.path.write_text(store.path.read_text().replace('"int8"', '"int4"'))
    assert store.load() is None and "damaged or of another version" in caplog.text


def test_a_strategy_of_an_older_version_is_read_and_saved_in_the_format(tmp_path, caplog):
    old = {"version": 7, "frozen": True, "workers": {}}
    (tmp_path / "strategy.json").write_text(json.dumps(old))  # as versions before the format wrote it
    store = StrategyStore(tmp_path)
    assert store.load() == old
    store.save(old)
    assert json.loads((tmp_path / "strategy.json").read_text())["format"] == "reame.strategy"
    assert store.load() == old
    (tmp_path / "strategy.json").write_text(json.dumps({**old, "format": "reame.strategy", "format_version": 99}))
    assert store.load() is None and "damaged or of another version" in caplog.text
