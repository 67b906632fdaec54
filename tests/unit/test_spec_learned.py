"""What the speculator learned outlives a restart: request classes' acceptance, the gate's
verdicts and the step-cost fit are saved beside the n-gram archive and resumed from, so the
first request after a restart drafts as the last one before it did; a damaged save starts fresh."""
from __future__ import annotations

import logging

from shared import saved_state
from worker.speculative import learned
from worker.speculative.archive import NgramArchive
from worker.speculative.archive_store import ArchiveStore
from worker.speculative.gate import SAMPLES
from worker.speculative.learned import LearnedState
from worker.speculative.speculator import PRIOR, SAVE_EVERY, Speculator, class_keys

MODEL = bytes(range(32))
PROMPT = list(range(100, 120))  # one request class (its first 16 tokens)
ANSWER = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]


def _store(path):
    return ArchiveStore(path, model=MODEL, order=3, budget_bytes=1 << 20)


def _speculator(store):
    return Speculator(max_draft=8, archive=NgramArchive(order=3, backing=store), memory=store)


def _serve(spec: Speculator, n: int) -> None:
    """n requests of one class whose answers are always confirmed; decode steps at 1 stream
    cost 10 ms + 1 ms per row: drafting measures 3.7x plain at 1 stream, 0.87x at 8."""
    for i in range(n):
        spec.begin(f"r{i}", PROMPT)
        for rows in (1, 4, 2, 6):
            spec.observe_step(rows, 0, 0.010 + 0.001 * rows, prompt_rows=rows)
        for _ in range(2):
            spec.observe("r%d" % i, 4, 4)
            spec.observe_step(5, 1, 0.015, emitted=5, drafted=True)
            spec.observe_step(1, 1, 0.011, emitted=1, drafted=False)
            spec.observe_step(16, 8, 0.026, emitted=10, drafted=True)
            spec.observe_step(8, 8, 0.018, emitted=8, drafted=False)
        spec.end(f"r{i}", PROMPT + ANSWER, num_prompt=len(PROMPT))


def test_a_restarted_speculator_resumes_classes_gate_and_cost_and_drafts_at_once(tmp_path, caplog):
    store = _store(tmp_path)
    spec = _speculator(store)
    _serve(spec, SAMPLES)
    assert spec.gate.snapshot()["gate_1+"] == "on" and spec.gate.snapshot()["gate_8+"] == "off"
    spec.save()
    store.close()

    fresh = _store(tmp_path)
    with caplog.at_level(logging.INFO, logger="reame.spec"):
        again = _speculator(fresh)
    assert any("speculation resumes: 1 request classes" in r.getMessage() for r in caplog.records)
    assert again.gate.snapshot() == spec.gate.snapshot()
    assert again.cost.fit() == spec.cost.fit()
    # The first request after the restart: a confirmed class drafts all it can, from the disk archive.
    again.begin("next", PROMPT)
    again.before_step(1)
    assert again.propose("next", PROMPT + ANSWER[:3], 8) == ANSWER[3:11]
    again.before_step(8)  # drafting measured slower at 8 streams: no draft there
    assert again.propose("next", PROMPT + ANSWER[:3], 8) == []
    # Without the saved state the same request starts from the prior and the gate measures.
    cold = Speculator(max_draft=8, archive=NgramArchive(order=3, backing=fresh))
    cold.begin("next", PROMPT)
    assert cold.gate.snapshot()["gate_1+"] == "measuring"
    assert len(cold.propose("next", PROMPT + ANSWER[:3], 8)) < 8
    fresh.close()


def test_state_is_saved_every_few_finished_sequences_behind_the_step_loop(tmp_path):
    store = _store(tmp_path)
    spec = _speculator(store)
    _serve(spec, SAVE_EVERY - 1)
    assert store.flush() and store.load_state() is None
    _serve(spec, 1)
    assert store.flush()
    state = learned.decode(store.load_state())
    assert state is not None and state.classes[0][0] == class_keys(PROMPT)[0] and state.classes[0][1] > PRIOR[0]
    store.close()


def test_a_damaged_or_foreign_save_is_ignored_with_a_warning(tmp_path, caplog):
    state = LearnedState([(1 << 32 | 12345, 3.0, 1.0, 4)], [([(1, 0.01)], [(3, 0.015)])], (1.0, 2.0, 3.0, 4.0, 5.0))
    blob = learned.encode(state)
    assert learned.decode(blob) == state
    flipped = blob[:-3] + bytes([blob[-3] ^ 1]) + blob[-2:]
    assert learned.decode(flipped) is None
    assert learned.decode(blob[:4]) is None and learned.decode(None) is None
    fields = saved_state.decode(blob, learned.KIND, learned.VERSION)
    older = saved_state.encode(learned.KIND, learned.VERSION - 1, fields)
    assert learned.decode(older) is None  # another version (2: its own binary header)

    store = _store(tmp_path)
    store.save_state(lambda: flipped)
    assert store.flush()
    with caplog.at_level(logging.WARNING, logger="reame.spec"):
        spec = _speculator(store)
    assert any("damaged or of another version" in r.getMessage() for r in caplog.records)
    assert spec.gate.snapshot()["gate_1+"] == "measuring" and spec.cost.fit() is None
    store.close()
    other = ArchiveStore(tmp_path, model=bytes(32), order=3, budget_bytes=1 << 20)
    assert other.load_state() is None  # another model's worker never resumes this one's state
    other.close()
