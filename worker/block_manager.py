"""The paged KV cache's bookkeeping: which fixed-size blocks are free, and who references each one.

The K/V arrays themselves belong to the engine; this class only hands out block ids.

Free-list order is FIFO: at start the queue is 0, 1, ..., num_blocks-1; allocation takes from the
head, and a block whose ref count drops to 0 goes to the tail. A sequence releases its blocks in
reverse block-table order, so its last (least shareable) block is reused first and its first blocks
(the prompt prefix, the most shareable) stay untouched longest. That is the order a prefix cache
wants for eviction (least recently freed first), so the later prefix-cache issue can keep it:
a freed block keeps its contents until it is handed out again, and `share()` may revive it from the
middle of the queue. The queue is an OrderedDict so that removal from the middle is O(1).

Ref counts: a block may sit in several sequences' block tables (shared prefix); it returns to the
free queue only when the last of them frees it.
"""
from __future__ import annotations

from collections import OrderedDict

from shared.errors import ConfigError
from worker.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16):
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ConfigError(f"the KV cache needs at least one block, got num_blocks={num_blocks!r}")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    # ---- sizes ---------------------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens. A caller rejects anything above num_blocks."""
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one sequence, 0.0 .. 1.0."""
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be allocated) first."""
        return list(self._free)

    # ---- allocate / free -----------------------------------------------------------------------

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks seq lacks so that its computed tokens plus num_new_tokens fit."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Grow seq.block_table from the head of the free queue; return the new block ids."""
        count = self.num_new_blocks(seq, num_new_tokens)
        if count > len(self._free):
            raise RuntimeError(f"allocate({seq.seq_id!r}) needs {count} blocks, "
                               f"{len(self._free)} free: call can_allocate first")
        new_ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self._ref_counts[block_id] = 1
            new_ids.append(block_id)
        seq.block_table.extend(new_ids)
        return new_ids

    def share(self, seq: Sequence, block_ids: list[int]) -> None:
        """Append existing blocks (in use, or free but not yet reused) to seq.block_table.

        For the prefix cache: the caller guarantees the blocks hold exactly the tokens seq has at
        those positions. A free block is taken out of the free queue, keeping its contents.
        """
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
        seq.block_table.extend(block_ids)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references, last block first; blocks nobody references join the free tail."""
        for block_id in reversed(seq.block_table):
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            self._ref_counts[block_id] = count
            if count == 0:
                self._free[block_id] = None
        seq.block_table.clear()
