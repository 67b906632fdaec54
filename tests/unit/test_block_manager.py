"""BlockManager: exact block ids from the FIFO free queue, growth by need, ref counts and sharing."""
from __future__ import annotations

import pytest

from shared.errors import ConfigError
from shared.sampling import SamplingParams
from worker.kv.block_manager import BlockManager
from worker.kv.sequence import Sequence


def _seq(name: str, num_tokens: int) -> Sequence:
    return Sequence(name, range(1, num_tokens + 1), SamplingParams(), arrival_time=0.0)


def test_blocks_needed_rounds_up():
    manager = BlockManager(num_blocks=8, block_size=4)
    assert [manager.blocks_needed(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    assert BlockManager(num_blocks=1).block_size == 16


def test_allocate_takes_the_lowest_ids_first_and_only_what_is_needed():
    manager = BlockManager(num_blocks=8, block_size=4)
    a, b = _seq("a", 10), _seq("b", 3)
    assert manager.allocate(a, 6) == [0, 1]
    assert manager.allocate(b, 3) == [2]
    assert a.block_table == [0, 1] and b.block_table == [2]

    a.num_computed_tokens = 6
    assert manager.allocate(a, 2) == []  # tokens 6, 7 still fit in block 1
    assert manager.allocate(a, 3) == [3]  # token 8 opens a third block
    assert a.block_table == [0, 1, 3]
    assert manager.num_free_blocks == 4 and manager.num_used_blocks == 4
    assert manager.usage == 0.5
    assert manager.free_block_ids() == [4, 5, 6, 7]


def test_free_returns_blocks_last_first_to_the_tail_and_they_are_reused_fifo():
    manager = BlockManager(num_blocks=6, block_size=4)
    a, b, c = _seq("a", 12), _seq("b", 8), _seq("c", 16)
    manager.allocate(a, 12)  # [0, 1, 2]
    manager.allocate(b, 8)  # [3, 4]
    manager.free(a)
    assert a.block_table == []
    assert manager.free_block_ids() == [5, 2, 1, 0]  # never-used 5 first, then a's blocks last-first
    assert [manager.ref_count(i) for i in range(6)] == [0, 0, 0, 1, 1, 0]

    assert manager.allocate(c, 16) == [5, 2, 1, 0]
    manager.free(b)
    assert manager.free_block_ids() == [4, 3]


def test_can_allocate_counts_missing_blocks_and_allocate_refuses_without_room():
    manager = BlockManager(num_blocks=3, block_size=4)
    a, b = _seq("a", 12), _seq("b", 8)
    assert manager.can_allocate(a, 12)
    assert not manager.can_allocate(a, 13)
    manager.allocate(a, 8)
    assert manager.num_new_blocks(b, 8) == 2
    assert not manager.can_allocate(b, 8)
    assert manager.can_allocate(b, 4)
    with pytest.raises(RuntimeError):
        manager.allocate(b, 8)
    assert b.block_table == [] and manager.num_free_blocks == 1  # a refused allocate changes nothing


def test_shared_block_returns_to_the_pool_only_when_its_last_owner_frees_it():
    manager = BlockManager(num_blocks=4, block_size=4)
    a, b = _seq("a", 8), _seq("b", 8)
    manager.allocate(a, 8)  # [0, 1]
    manager.share(b, [0])  # b reuses a's first block (same prefix)
    b.num_computed_tokens = 4
    manager.allocate(b, 4)  # b's own second block
    assert b.block_table == [0, 2]
    assert [manager.ref_count(i) for i in range(4)] == [2, 1, 1, 0]
    assert manager.num_used_blocks == 3

    manager.free(a)
    assert [manager.ref_count(i) for i in range(4)] == [1, 0, 1, 0]
    assert manager.free_block_ids() == [3, 1]
    manager.free(b)
    assert manager.free_block_ids() == [3, 1, 2, 0]
    assert manager.num_free_blocks == 4 and manager.usage == 0.0


def test_share_revives_a_free_block_from_the_middle_of_the_queue():
    manager = BlockManager(num_blocks=4, block_size=4)
    a, b = _seq("a", 8), _seq("b", 8)
    manager.allocate(a, 8)
    manager.free(a)
    assert manager.free_block_ids() == [2, 3, 1, 0]
    manager.share(b, [1])
    assert manager.ref_count(1) == 1
    assert manager.free_block_ids() == [2, 3, 0]
    manager.free(b)
    assert manager.free_block_ids() == [2, 3, 0, 1]


def test_freeing_twice_is_harmless_because_the_table_is_cleared():
    manager = BlockManager(num_blocks=2, block_size=4)
    a = _seq("a", 4)
    manager.allocate(a, 4)
    manager.free(a)
    manager.free(a)
    assert manager.free_block_ids() == [1, 0]


@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (-1, 16), (4, 0), (True, 16), (4, 2.0)])
def test_bad_sizes_are_config_errors(num_blocks, block_size):
    with pytest.raises(ConfigError):
        BlockManager(num_blocks, block_size)
