"""Window slots: exact slot ids, retention of named blocks, eviction order, and the block
manager's window references (tests/model/test_window_kv.py runs them under a real model)."""
from __future__ import annotations

import pytest

from shared.errors import ConfigError
from shared.sampling import SamplingParams
from worker.kv.block_manager import BlockManager
from worker.kv.sequence import Sequence
from worker.kv.window_slots import WindowSlots

BS, WINDOW = 4, 8  # a query sees itself and the 7 keys before it: at most 3 blocks


def _seq(name: str, num_tokens: int) -> Sequence:
    return Sequence(name, list(range(num_tokens)), SamplingParams(max_tokens=4), arrival_time=0.0)


def _manager(num_blocks=16, slots=6) -> BlockManager:
    return BlockManager(num_blocks, BS, WindowSlots(slots, num_blocks, WINDOW, BS))


def _advance(manager: BlockManager, seq: Sequence, tokens: int) -> None:
    manager.allocate(seq, tokens)
    seq.num_computed_tokens += tokens
    manager.slide(seq)


def _named_blocks(manager: BlockManager, count: int = 4) -> Sequence:
    """A sequence that computed `count` blocks one at a time, each named as it filled."""
    seq = _seq("a", 40)
    for i in range(count):
        _advance(manager, seq, BS)
        manager.register(seq.block_table[i], bytes([i]) * 32, seq.block_token_ids(i, BS))
    return seq


def test_first_block_is_the_oldest_a_query_can_see():
    slots = WindowSlots(4, 8, WINDOW, BS)
    assert [slots.first_block(p) for p in (0, 7, 8, 11, 12, 15, 16)] == [0, 0, 0, 1, 1, 2, 2]


def test_a_sequence_holds_slots_only_for_its_window_and_frees_unnamed_ones_at_once():
    manager = _manager()
    slots = manager.window
    seq = _seq("a", 40)
    _advance(manager, seq, 8)  # blocks 0, 1 (slots 0, 1); next query at 8 sees from block 0
    assert list(manager.window_table(seq.block_table)) == [0, 1] and seq.window_start == 0
    _advance(manager, seq, 8)  # blocks 2, 3 get slots 2, 3; the next query (16) sees from 2
    assert seq.window_start == 2
    assert list(manager.window_table(seq.block_table)) == [-1, -1, 2, 3]
    assert slots.num_referenced == 2 and slots.num_available == 4
    _advance(manager, seq, 4)  # block 4 takes the oldest free slot: 4
    assert list(manager.window_table(seq.block_table))[2:] == [-1, 3, 4]
    manager.free(seq)
    assert slots.num_referenced == 0 and slots.num_available == 6
    assert manager.num_used_blocks == 0


def test_named_blocks_keep_their_slots_until_allocation_needs_them_oldest_first():
    manager = _manager(slots=4)
    slots = manager.window
    seq = _named_blocks(manager)
    # Blocks 0 and 1 fell out of the window named: retained (still resident), not freed.
    assert slots.resident(0) and slots.resident(1) and slots.refs(0) == 0
    assert slots.num_referenced == 2 and slots.num_available == 2
    manager.free(seq)  # 3, then 2 join the LRU after 0 and 1
    assert slots.num_available == 4 and all(slots.resident(b) for b in range(4))
    other = _seq("b", 12)
    _advance(manager, other, 8)  # two fresh blocks (4, 5) evict the two oldest: blocks 0 and 1
    assert [slots.resident(b) for b in range(6)] == [False, False, True, True, True, True]
    assert slots.num_evictions == 2
    manager.free(other)
    assert slots.num_available == 4


def test_usable_prefix_stops_where_the_window_of_the_next_query_lost_its_slots():
    manager = _manager(slots=4)
    manager.free(_named_blocks(manager))
    found = [0, 1, 2, 3]
    assert manager.usable_prefix(found) == 4
    manager.window.drop(3)  # block 3's window layers are gone
    assert manager.usable_prefix(found) == 3  # resuming at token 12 needs blocks 1 and 2
    manager.window.drop(1)
    assert manager.usable_prefix(found) == 1  # at 8 it needs blocks 0 and 1; at 4 only block 0
    manager.window.drop(0)
    assert manager.usable_prefix(found) == 0
    assert _manager().usable_prefix([]) == 0


def test_sharing_a_prefix_references_only_the_blocks_the_next_query_sees():
    manager = _manager(slots=6)
    manager.free(_named_blocks(manager))
    again = _seq("b", 40)
    manager.share(again, [0, 1, 2, 3])  # resumes at 16: sees from block 2
    assert again.window_start == 2
    assert [manager.window.refs(b) for b in range(4)] == [0, 0, 1, 1]
    manager.free(again)
    assert manager.window.num_referenced == 0


def test_allocation_needs_window_slots_too():
    manager = _manager(num_blocks=16, slots=2)
    seq = _seq("a", 40)
    assert manager.can_allocate(seq, 8) and not manager.can_allocate(seq, 12)
    with pytest.raises(RuntimeError, match="can_allocate"):
        manager.allocate(seq, 12)


def test_misuse_raises():
    slots = WindowSlots(2, 4, WINDOW, BS)
    slots.acquire_new(0)
    with pytest.raises(RuntimeError, match="still attends"):
        slots.drop(0)
    with pytest.raises(RuntimeError, match="no window slot"):
        slots.acquire(1)
    slots.release(0, keep=False)
    with pytest.raises(RuntimeError, match="more often"):
        slots.release(0, keep=False)
    with pytest.raises(ConfigError):
        WindowSlots(0, 4, WINDOW, BS)
