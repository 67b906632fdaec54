"""The paged KV cache's bookkeeping: which fixed-size blocks are free, who references each one,
and which blocks still hold a known prefix (the RAM tier of the prefix cache).

The K/V arrays themselves belong to the engine; this class only hands out block ids.

Two free lists:
- `empty`: blocks whose contents nobody can name. FIFO: at start 0, 1, ..., num_blocks-1;
  allocation takes from the head, a freed block goes to the tail.
- `cached`: free blocks that still hold a full block of K/V registered under its chain hash
  (shared.hashing). An LRU, oldest first. Allocation evicts from here only when `empty` is
  exhausted, so computed prefixes survive as long as memory allows.
A sequence releases its blocks in reverse block-table order, so the tail of a chain becomes
least recently used before its head: eviction shortens chains from the end, and what survives
is always a usable prefix.

Partial blocks: a finished sequence's last block, whose first tokens (fewer than a block) hold
computed K/V, can be kept too (`register_partial`), free and evictable like a named block.
`continuation()` finds, among the full and partial blocks that follow a named prefix, the one
sharing the most leading tokens with a new request; the prefix cache copies those tokens' K/V
into the request's own block. So a request that repeats, or continues, an earlier one computes
only what is new, not up to a block of tokens again (llama-server's slots keep the whole prompt
for the same reason). Partial blocks are never shared: they are only ever copied from.

Ref counts: a block may sit in several sequences' block tables (a shared prefix); it returns to a
free list only when the last of them frees it. `share()` revives a free block, keeping its
contents.

Window slots (models with sliding-window layers, worker.kv.window_slots): every allocated block also
gets a slot for those layers' K/V, and a sequence holds a reference on the slots of the blocks
its next query can attend to (`seq.window_start` on); `slide()` lets go of the rest as it moves.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Tokens

import numpy as np

from shared.errors import ConfigError
from worker.engine.paged_kv import PagedKVCache
from worker.kv.sequence import Sequence
from worker.kv.window_slots import WindowSlots

# Kept partial blocks per prefix name: a popular system prompt followed by many different
# questions keeps the newest few continuations, not one block per question.
MAX_PARTIALS_PER_PARENT = 4


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, window: WindowSlots | None = None):
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ConfigError(f"the KV cache needs at least one block, got num_blocks={num_blocks!r}")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._empty: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # free but named: LRU, oldest first
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._tokens_of: list[tuple[int, ...] | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}  # chain hash -> the block holding it (used or free)
        # The name a block's tokens follow (ZERO_HASH/namespace root for block 0), and per name
        # the blocks that continue it, full or partial, oldest first: continuation() reads them.
        self._parent_of: list[bytes | None] = [None] * num_blocks
        self._children: dict[bytes, list[int]] = {}
        self.num_evictions = 0  # named blocks reused for other contents
        self.window = window

    @classmethod
    def for_pool(cls, kv: PagedKVCache) -> "BlockManager":
        """The manager of every block (and sliding-window slot) of an engine's KV pool."""
        window = None
        if kv.window is not None:
            window = WindowSlots(kv.window.slots, kv.num_blocks, kv.window.tokens, kv.block_size)
        return cls(kv.num_blocks, kv.block_size, window)

    # ---- sizes ---------------------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens. A caller rejects anything above num_blocks."""
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self._empty) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a named prefix block (or a partial one)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one sequence, 0.0 .. 1.0."""
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """Free blocks in allocation order: empty ones (FIFO), then named ones (least recent first)."""
        return list(self._empty) + list(self._cached)

    def cached_block_ids(self) -> list[int]:
        """Free named blocks, least recently used (next to be evicted) first."""
        return list(self._cached)

    # ---- the prefix index ----------------------------------------------------------------------

    def register(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...],
                 parent: bytes | None = None) -> bool:
        """Name a block whose K/V for token_ids (a full block) are computed; False when another
        block already holds that name (two sequences computed the same prefix at once). With
        `parent` (the name before it), continuation() can also find its leading tokens."""
        if self._hash_of[block_id] is not None:
            return self._hash_of[block_id] == block_hash
        if block_hash in self._block_of:
            return False
        if self._tokens_of[block_id] is not None:
            raise RuntimeError(f"block {block_id} is a kept partial block; it is never written again")
        self._hash_of[block_id] = block_hash
        self._tokens_of[block_id] = token_ids
        self._block_of[block_hash] = block_id
        if parent is not None:
            self._parent_of[block_id] = parent
            self._children.setdefault(parent, []).append(block_id)
        return True

    def register_partial(self, block_id: int, parent: bytes, token_ids: tuple[int, ...]) -> bool:
        """Keep a block whose first len(token_ids) (< block_size) tokens have computed K/V, after
        the prefix named `parent`: called by its only holder just before free(). False when it is
        not kept: a block already found by continuation() covers those tokens.

        Kept partial blocks of one parent that these tokens extend are dropped (the new one serves
        all they served), and at most MAX_PARTIALS_PER_PARENT stay, so distinct continuations
        of one popular prefix cannot fill the pool's free list."""
        if not 0 < len(token_ids) < self.block_size:
            raise ValueError(f"a partial block holds 1..{self.block_size - 1} tokens, got {len(token_ids)}")
        if self._ref_counts[block_id] != 1 or self._tokens_of[block_id] is not None:
            raise RuntimeError(f"block {block_id} must be unnamed and held once to be kept as partial")
        siblings = self._children.get(parent, [])
        if any(self._tokens_of[b][:len(token_ids)] == token_ids for b in siblings):
            return False
        dominated = [b for b in siblings if self._hash_of[b] is None and token_ids[:len(self._tokens_of[b])] == self._tokens_of[b]]
        partials = [b for b in siblings if self._hash_of[b] is None and b not in dominated]
        dominated += partials[:max(0, len(partials) + 1 - MAX_PARTIALS_PER_PARENT)]  # the oldest go
        for b in dominated:
            self._discard(b)
        self._tokens_of[block_id] = token_ids
        self._parent_of[block_id] = parent
        self._children.setdefault(parent, []).append(block_id)
        return True

    def continuation(self, parent: bytes, token_ids: Tokens[int]) -> tuple[int | None, int]:
        """(block, n): the block after prefix `parent` whose first n tokens are the first n of
        token_ids, n as large as possible (and < block_size); (None, 0) when none shares one.
        A window model's block must still hold its window slot (its local layers' K/V)."""
        wanted = tuple(token_ids[:self.block_size - 1])
        best, best_n = None, 0
        for block_id in self._children.get(parent, ()):
            if self.window is not None and not self.window.resident(block_id):
                continue
            have = self._tokens_of[block_id]
            n = 0
            for a, b in zip(have, wanted):
                if a != b:
                    break
                n += 1
            if n > best_n:
                best, best_n = block_id, n
        return best, best_n

    def pin(self, block_id: int) -> None:
        """Hold a found block (and its window slot) while its contents are copied: an allocation
        meanwhile cannot evict it. unpin() returns it where it was."""
        if self._tokens_of[block_id] is None:
            raise RuntimeError(f"block {block_id} holds nothing that can be found; nothing to pin")
        if self._ref_counts[block_id] == 0:
            self._cached.pop(block_id)
        self._ref_counts[block_id] += 1
        if self.window is not None:
            self.window.acquire(block_id)

    def unpin(self, block_id: int) -> None:
        if self.window is not None:
            self.window.release(block_id, keep=True)
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._cached[block_id] = None

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        """The block holding this name, if its token ids match too; None otherwise."""
        block_id = self._block_of.get(block_hash)
        if block_id is None or self._tokens_of[block_id] != token_ids:
            return None
        return block_id

    def block_hash(self, block_id: int) -> bytes | None:
        return self._hash_of[block_id]

    # ---- allocate / free -----------------------------------------------------------------------

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks seq lacks so that its computed tokens plus num_new_tokens fit."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        count = self.num_new_blocks(seq, num_new_tokens)
        return count <= self.num_free_blocks and (self.window is None or count <= self.window.num_available)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Grow seq.block_table from the head of the free queue; return the new block ids."""
        count = self.num_new_blocks(seq, num_new_tokens)
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError(f"allocate({seq.seq_id!r}) needs {count} blocks, "
                               f"{self.num_free_blocks} free: call can_allocate first")
        new_ids = [self._take_free() for _ in range(count)]
        seq.block_table.extend(new_ids)
        if self.window is not None:
            for block_id in new_ids:
                self.window.acquire_new(block_id)
        return new_ids

    def _take_free(self) -> int:
        if self._empty:
            block_id, _ = self._empty.popitem(last=False)
        else:
            block_id, _ = self._cached.popitem(last=False)
            self._forget(block_id)
            self.num_evictions += 1
        if self.window is not None:
            self.window.drop(block_id)  # a retained slot of the old contents
        self._ref_counts[block_id] = 1
        return block_id

    def _forget(self, block_id: int) -> None:
        if self._hash_of[block_id] is not None:
            del self._block_of[self._hash_of[block_id]]
        parent = self._parent_of[block_id]
        if parent is not None:
            siblings = self._children[parent]
            siblings.remove(block_id)
            if not siblings:
                del self._children[parent]
        self._hash_of[block_id] = None
        self._tokens_of[block_id] = None
        self._parent_of[block_id] = None

    def _discard(self, block_id: int) -> None:
        """A free kept block nobody will look for again: unnamed, and empty."""
        self._cached.pop(block_id)
        self._forget(block_id)
        if self.window is not None:
            self.window.drop(block_id)
        self._empty[block_id] = None

    def share(self, seq: Sequence, block_ids: list[int]) -> None:
        """Append existing blocks (in use, or free but not yet reused) to seq.block_table.

        For the prefix cache: the caller guarantees the blocks hold exactly the tokens seq has at
        those positions. A free block is taken out of the free queue, keeping its contents.
        With window slots, the blocks the next query attends to must be resident (usable_prefix).
        """
        old = len(seq.block_table)
        for block_id in block_ids:
            if self._hash_of[block_id] is None and self._tokens_of[block_id] is not None:
                raise RuntimeError(f"block {block_id} is partial: copy from it, never share it")
            if self._ref_counts[block_id] == 0:
                (self._cached if self._hash_of[block_id] is not None else self._empty).pop(block_id)
            self._ref_counts[block_id] += 1
        seq.block_table.extend(block_ids)
        if self.window is not None:
            start = self.window.first_block(len(seq.block_table) * self.block_size)
            for block_id in seq.block_table[max(old, start):]:
                self.window.acquire(block_id)
            self._release_window(seq, min(start, old))
            seq.window_start = max(seq.window_start, start)

    def usable_prefix(self, block_ids: list[int]) -> int:
        """How many leading blocks of a found prefix a sequence can resume after: with window
        slots, every block its next query attends to must still hold its slot."""
        n = len(block_ids)
        if self.window is None:
            return n
        while n and not all(self.window.resident(b) for b in block_ids[self.window.first_block(n * self.block_size):n]):
            n -= 1
        return n

    # ---- window slots ----------------------------------------------------------------------------

    def slide(self, seq: Sequence) -> None:
        """After seq computed more tokens: let go of the window slots its next query cannot see."""
        if self.window is not None:
            self._release_window(seq, self.window.first_block(seq.num_computed_tokens))

    def window_table(self, block_table) -> np.ndarray | None:
        """The window slot of each block in block_table (-1: none), or None without a window pool."""
        if self.window is None:
            return None
        return self.window.slot_of[np.asarray(block_table, np.int64)]

    def _release_window(self, seq: Sequence, upto: int) -> None:
        """Release seq's window references on blocks [seq.window_start, upto), last first."""
        upto = min(upto, len(seq.block_table))
        for i in range(upto - 1, seq.window_start - 1, -1):
            block_id = seq.block_table[i]
            self.window.release(block_id, keep=self._tokens_of[block_id] is not None)
        seq.window_start = max(seq.window_start, upto)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Free seq's blocks past the first num_tokens tokens, last first (rejected draft rows:
        their K/V are garbage, so the blocks go back unnamed)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            if self._hash_of[block_id] is not None:
                raise RuntimeError(f"block {block_id} is named; truncate() only drops uncomputed tokens")
            if self.window is not None and len(seq.block_table) >= seq.window_start:
                self.window.release(block_id, keep=False)
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            self._ref_counts[block_id] = count
            if count == 0:
                self._empty[block_id] = None
        if self.window is not None:
            seq.window_start = min(seq.window_start, len(seq.block_table))

    def free(self, seq: Sequence) -> None:
        """Drop seq's references, last block first; blocks nobody references join the tail of
        their free list (named blocks: the most recently used end of the LRU)."""
        if self.window is not None:
            self._release_window(seq, len(seq.block_table))
            seq.window_start = 0
        for block_id in reversed(seq.block_table):
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            self._ref_counts[block_id] = count
            if count == 0:
                (self._cached if self._tokens_of[block_id] is not None else self._empty)[block_id] = None
        seq.block_table.clear()
