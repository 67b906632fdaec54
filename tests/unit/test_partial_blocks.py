"""Partial blocks in the prefix cache's RAM tier: a finished sequence's partly computed last block
is kept, a later request copies the K/V of the leading tokens it shares with any block after its
cached prefix (full or partial) into a block of its own, and what is kept stays bounded, evictable
and never shared."""
from __future__ import annotations

import numpy as np
import pytest

from shared.hashing import ZERO_HASH, extend_chain, kv_fingerprint
from shared.sampling import SamplingParams
from worker.engine.paged_kv import KVShape, PagedKVCache
from worker.kv.block_manager import MAX_PARTIALS_PER_PARENT, BlockManager
from worker.kv.prefix_cache import PrefixCache
from worker.kv.sequence import Sequence
from worker.sched.scheduler import Scheduler
from worker.sched.tuning_state import SchedulerKnobs, TuningState

FP = kv_fingerprint(model="test", kv_dtype="float32")
BS = 4
PARENT = b"p" * 32


def _seq(name: str, prompt: list[int], max_tokens: int = 1) -> Sequence:
    return Sequence(name, prompt, SamplingParams(max_tokens=max_tokens), arrival_time=0.0)


def _stack(num_blocks: int = 16) -> tuple[Scheduler, BlockManager, PagedKVCache]:
    manager = BlockManager(num_blocks, BS)
    kv = PagedKVCache(KVShape(n_layers=2, n_kv_heads=1, head_dim=2, block_size=BS), num_blocks)
    scheduler = Scheduler(manager, TuningState(SchedulerKnobs(batching_window_ms=0.0)),
                          PrefixCache(manager, FP, kv=kv))
    return scheduler, manager, kv


def _step(scheduler: Scheduler, kv: PagedKVCache, token: int = 7):
    """One schedule/update round; the 'engine' stamps every block it computes into with its
    position values, so a copy can be told from a recompute."""
    batch = scheduler.schedule(0.0)
    for chunk in batch.chunks:
        for pos in range(chunk.start, chunk.start + chunk.num_tokens):
            block = chunk.seq.block_table[pos // BS]
            kv.k[block, :, :, :, pos % BS] = chunk.seq.token_ids[pos]
    scheduler.update(batch, {c.seq.seq_id: token for c in batch.chunks if c.samples})
    return batch


def _finish(scheduler: Scheduler, kv: PagedKVCache) -> None:
    while scheduler.has_work():
        _step(scheduler, kv)


def test_a_repeated_prompt_copies_everything_but_its_last_token():
    scheduler, manager, kv = _stack()
    prompt = list(range(100, 110))  # 10 tokens: blocks 0, 1 full, block 2 holds 2
    scheduler.add(_seq("a", prompt))
    _finish(scheduler, kv)
    assert manager.num_cached_blocks == 3  # the partial block 2 is kept too

    b = _seq("b", prompt)
    scheduler.add(b)
    batch = _step(scheduler, kv)
    assert [(c.start, c.num_tokens) for c in batch.chunks] == [(9, 1)]  # one row: the last token
    assert b.num_cached_tokens == 9 and b.partial_tokens == 1
    assert scheduler.prefix.counters.prefix_hit_tokens_ram == 9


def test_a_copy_is_the_sources_kv_and_writing_it_leaves_the_source_alone():
    scheduler, manager, kv = _stack()
    scheduler.add(_seq("a", list(range(100, 111))))  # 11 tokens: block 2 holds 3
    _finish(scheduler, kv)
    source, count = manager.continuation(_chain(list(range(100, 111)), 2), [108, 109, 55])
    assert count == 2
    before = kv.k[source].copy()

    b = _seq("b", [*range(100, 110), 55, 56], max_tokens=3)  # shares 10 tokens, differs inside block 2
    scheduler.add(b)
    _step(scheduler, kv)
    target = b.block_table[2]
    assert target != source and b.num_cached_tokens == 10
    assert np.array_equal(kv.k[target, ..., :2], before[..., :2])  # copied, not recomputed
    assert np.all(kv.k[target, ..., 2] == 55)  # b's own token where it differs
    assert np.array_equal(kv.k[source], before)


def test_a_block_in_use_by_a_running_sequence_is_copied_from_not_shared():
    scheduler, manager, kv = _stack()
    a = _seq("a", list(range(100, 112)), max_tokens=5)  # 12 tokens: 3 full blocks, then decoding
    scheduler.add(a)
    _step(scheduler, kv)
    b = _seq("b", [*range(100, 110), 60], max_tokens=3)  # 2 of a's block 2's tokens, then its own
    scheduler.add(b)
    _step(scheduler, kv)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert manager.ref_count(a.block_table[2]) == 1 and b.num_cached_tokens == 10
    _finish(scheduler, kv)
    assert manager.num_used_blocks == 0


def test_a_sequence_sent_back_to_wait_finds_its_partial_block_again():
    scheduler, manager, kv = _stack()
    seq = _seq("a", list(range(100, 110)))
    seq.num_computed_tokens = 0
    scheduler.prefix.attach(seq)
    manager.allocate(seq, 10)
    seq.num_computed_tokens = 6  # blocks 0 named, 1 half done (as after a 6-token chunk)
    scheduler.prefix.commit(seq)
    scheduler.prefix.release(seq)
    seq.num_computed_tokens = seq.num_named_blocks = 0
    assert scheduler.prefix.attach(seq) == 6 and seq.partial_tokens == 2


def _keep(manager: BlockManager, tokens: tuple[int, ...]) -> tuple[int, bool]:
    """A one-token sequence's block kept as a partial block of PARENT holding `tokens`."""
    seq = _seq("s", [0])
    manager.allocate(seq, 1)
    block = seq.block_table[0]
    kept = manager.register_partial(block, PARENT, tokens)
    manager.free(seq)
    return block, kept


def test_a_partial_block_is_kept_once_and_longer_ones_replace_shorter_ones():
    manager = BlockManager(8, BS)
    short, kept_short = _keep(manager, (1,))
    longer, kept_longer = _keep(manager, (1, 2))
    _, kept_again = _keep(manager, (1, 2))
    assert kept_short and kept_longer and not kept_again
    assert manager.continuation(PARENT, [1, 2, 3]) == (longer, 2)
    assert manager.num_cached_blocks == 1  # (1,) was dropped for (1, 2); the second (1, 2) not kept


def test_at_most_a_few_partial_blocks_per_prefix_name():
    manager = BlockManager(16, BS)
    for first in range(MAX_PARTIALS_PER_PARENT + 2):
        _keep(manager, (first, 1))
    assert manager.num_cached_blocks == MAX_PARTIALS_PER_PARENT
    assert manager.continuation(PARENT, [0, 1])[1] == 0  # the oldest went
    assert manager.continuation(PARENT, [MAX_PARTIALS_PER_PARENT + 1, 1])[1] == 2


def test_an_evicted_partial_block_is_not_found_and_a_pinned_one_is_not_evicted():
    manager = BlockManager(2, BS)
    partial, _ = _keep(manager, (5, 6))

    manager.pin(partial)
    other = _seq("o", [0])
    manager.allocate(other, 1)  # the empty block, not the pinned one
    assert other.block_table != [partial] and not manager.can_allocate(other, 2 * BS)
    manager.unpin(partial)
    manager.free(other)

    taker = _seq("t", [0])
    manager.allocate(taker, 2 * BS)  # needs both blocks: the partial one is evicted
    assert manager.continuation(PARENT, [5, 6]) == (None, 0)


def test_a_partial_block_is_never_shared():
    manager = BlockManager(4, BS)
    block, _ = _keep(manager, (5,))
    with pytest.raises(RuntimeError, match="partial"):
        manager.share(_seq("x", [0]), [block])


def test_a_partial_block_needs_fewer_than_a_block_of_tokens_and_a_single_holder():
    manager = BlockManager(4, BS)
    seq = _seq("s", [0])
    manager.allocate(seq, 1)
    with pytest.raises(ValueError):
        manager.register_partial(seq.block_table[0], PARENT, (1, 2, 3, 4))
    manager.register(seq.block_table[0], b"n" * 32, (1, 2, 3, 4), ZERO_HASH)
    with pytest.raises(RuntimeError):
        manager.register_partial(seq.block_table[0], PARENT, (1,))


def _chain(tokens: list[int], blocks: int) -> bytes:
    """The name of the first `blocks` full blocks of tokens."""
    return extend_chain([], tokens, BS, blocks, FP)[-1]
