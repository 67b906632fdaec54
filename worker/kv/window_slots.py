"""Window slots: which blocks have their sliding-window layers' K/V in the window pool.

A model whose local layers attend only the last `window_tokens` keys (Gemma 3) needs those
layers' K/V of a block only while some sequence can still attend to it. The block manager gives
each block a slot when it is allocated, and every sequence holds a window reference on its blocks
from the first one its next query can see (`first_block`) to its end; the reference is dropped
as the sequence moves on (worker.kv.block_manager.BlockManager.slide).

A slot nobody references:
- of a named block (a prefix the RAM cache can give again) is *retained*, least recently used
  first, so a later request that resumes inside that prefix finds the window it needs;
- of an unnamed block is freed at once (nobody can ask for its contents again).
Allocation takes free slots first, then evicts the oldest retained one; a block whose slot is
gone keeps its main-pool K/V, so it still serves as the early part of a prefix.
"""
from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from shared.errors import ConfigError


class WindowSlots:
    def __init__(self, num_slots: int, num_blocks: int, window_tokens: int, block_size: int):
        if num_slots < 1 or window_tokens < 1:
            raise ConfigError(f"the window pool needs slots and a window, got {num_slots} slots, "
                              f"{window_tokens}-token window")
        self.num_slots = num_slots
        self.window_tokens = window_tokens
        self.block_size = block_size
        self.slot_of = np.full(num_blocks, -1, np.int32)  # block id -> its slot, -1 when none
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_slots))
        self._retained: OrderedDict[int, None] = OrderedDict()  # block ids, least recently used first
        self.num_evictions = 0

    # ---- sizes ---------------------------------------------------------------------------------

    def first_block(self, next_position: int) -> int:
        """The first block a query at next_position (or later) can attend to."""
        return max(0, next_position - self.window_tokens + 1) // self.block_size

    @property
    def num_available(self) -> int:
        """Slots an allocation can take: free ones, then retained ones (evicted)."""
        return len(self._free) + len(self._retained)

    @property
    def num_referenced(self) -> int:
        return self.num_slots - self.num_available

    def resident(self, block_id: int) -> bool:
        return self.slot_of[block_id] >= 0

    def refs(self, block_id: int) -> int:
        return self._refs[block_id]

    # ---- references ----------------------------------------------------------------------------

    def acquire_new(self, block_id: int) -> None:
        """A freshly allocated block: give it a slot and one reference."""
        if self.slot_of[block_id] >= 0:
            self.drop(block_id)
        if self._free:
            slot = self._free.popleft()
        elif self._retained:
            victim, _ = self._retained.popitem(last=False)
            slot = int(self.slot_of[victim])
            self.slot_of[victim] = -1
            self.num_evictions += 1
        else:
            raise RuntimeError(f"no window slot for block {block_id}: check num_available first")
        self.slot_of[block_id] = slot
        self._refs[block_id] = 1

    def acquire(self, block_id: int) -> None:
        """One more reference on a resident block (a sequence reusing it as a prefix)."""
        if self.slot_of[block_id] < 0:
            raise RuntimeError(f"block {block_id} has no window slot to share")
        self._retained.pop(block_id, None)
        self._refs[block_id] += 1

    def release(self, block_id: int, keep: bool) -> None:
        """Drop one reference; at none, retain the slot (keep: the block is named) or free it."""
        count = self._refs[block_id] - 1
        if count < 0 or self.slot_of[block_id] < 0:
            raise RuntimeError(f"window slot of block {block_id} released more often than acquired")
        self._refs[block_id] = count
        if count == 0:
            if keep:
                self._retained[block_id] = None
            else:
                self._free_slot(block_id)

    def drop(self, block_id: int) -> None:
        """The block's contents are being replaced: its retained slot (if any) is free again."""
        if self._refs[block_id]:
            raise RuntimeError(f"block {block_id} is reused while a sequence still attends to it")
        if self.slot_of[block_id] >= 0:
            self._retained.pop(block_id, None)
            self._free_slot(block_id)

    def _free_slot(self, block_id: int) -> None:
        self._free.append(int(self.slot_of[block_id]))
        self.slot_of[block_id] = -1
