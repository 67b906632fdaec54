"""Prefix reuse: a new request starts from the K/V of the longest prefix already computed.

Two tiers, searched in order, block by block along the request's hash chain (shared.hashing):
1. RAM: blocks of this worker's pool that are registered under their chain hash
   (worker.kv.block_manager keeps them, free or in use, until their memory is needed);
2. the host's LMDB store (worker.kv.store), shared by every worker and kept across restarts:
   a run of stored blocks is restored into fresh pool blocks, or left to be recomputed when
   that is cheaper, as measured on this host (restore bytes/s against prefill tokens/s).
Past the last full block found, a request takes the leading tokens it shares with a block that
follows that prefix (full, or the partial last block of a finished sequence) by copying their K/V
into its own block. The last prompt token is always recomputed, because sampling needs its logits:
a request that repeats an earlier one computes that one row, whatever its length.

After every engine step `commit()` names each newly full block and hands a copy of its K/V to
the store's writer thread, so the store fills behind the request path and never holds a block
before its write has committed.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from shared.hashing import extend_chain, namespace_root
from worker.kv.block_manager import BlockManager
from worker.kv.sequence import Sequence

log = logging.getLogger("reame.prefix")

RESTORE_MODES = ("auto", "always", "never")


@dataclass
class PrefixCounters:
    """Cumulative since the worker started; the heartbeat carries them to /metrics."""
    prefix_query_tokens: int = 0
    prefix_hit_tokens_ram: int = 0
    prefix_hit_tokens_store: int = 0
    prefix_restores: int = 0
    prefix_recomputes: int = 0


class Rate:
    """An exponentially weighted average of amount per second (restore bytes/s, prefill tokens/s)."""

    def __init__(self, weight: float = 0.3):
        self.weight = weight
        self.per_second: float | None = None

    def observe(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        self.per_second = rate if self.per_second is None else (
            (1 - self.weight) * self.per_second + self.weight * rate)

    def seconds_for(self, amount: float) -> float | None:
        return None if self.per_second is None else amount / self.per_second


class PrefixCache:
    def __init__(self, block_manager: BlockManager, fingerprint: bytes, *, kv=None, store=None,
                 writer=None, restore: str = "auto", clock: Callable[[], float] = time.perf_counter):
        if restore not in RESTORE_MODES:
            raise ValueError(f"restore must be one of {RESTORE_MODES}, got {restore!r}")
        if store is not None and kv is None:
            raise ValueError("the store tier needs the KV pool to copy blocks in and out")
        self.block_manager = block_manager
        self.fingerprint = fingerprint
        self.kv = kv  # worker.engine.paged_kv.PagedKVCache: partial-block copies and the store tier
        self.store = store
        self.writer = writer
        self.restore_mode = restore
        self.clock = clock
        self.counters = PrefixCounters()
        self.restore_rate = Rate()  # bytes/s from the store into the pool
        self.prefill_rate = Rate()  # prompt tokens/s of engine steps

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    # ---- admission ------------------------------------------------------------------------------

    def attach(self, seq: Sequence) -> int:
        """Give a fresh sequence the blocks of its longest cached prefix; return its cached tokens."""
        if seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"attach() takes a sequence without blocks, got {seq!r}")
        bs = self.block_size
        usable = (seq.num_tokens - 1) // bs  # the last token is always fed: it gives the logits
        chain = extend_chain(seq.block_hashes, seq.token_ids, bs, usable, self.fingerprint,
                             namespace_root(seq.cache_namespace))
        manager = self.block_manager
        in_ram = []
        for i in range(usable):
            block_id = manager.lookup(chain[i], seq.block_token_ids(i, bs))
            if block_id is None:
                break
            in_ram.append(block_id)
        # A window model resumes only where its sliding-window layers' recent K/V are still held.
        in_ram = in_ram[:manager.usable_prefix(in_ram)]
        manager.share(seq, in_ram)
        seq.num_computed_tokens = len(in_ram) * bs
        restored = self._restore(seq, chain, len(in_ram), usable) if self.store is not None else 0
        blocks = len(in_ram) + restored
        seq.num_computed_tokens = blocks * bs
        seq.num_named_blocks = blocks
        seq.ram_blocks, seq.store_blocks = len(in_ram), restored
        if self.writer is not None and blocks:
            self.writer.touch(chain[:blocks])  # keeps popular prefixes at the young end of the store's LRU
        root = namespace_root(seq.cache_namespace)
        seq.partial_tokens = self._copy_partial(seq, chain[blocks - 1] if blocks else root)
        return seq.num_computed_tokens

    def _copy_partial(self, seq: Sequence, parent: bytes) -> int:
        """Copy the K/V of the longest run of seq's next tokens (short of its last) that a block
        after `parent` already holds into a block of seq's own; return how many tokens."""
        bs = self.block_size
        start = seq.num_computed_tokens
        wanted = seq.token_ids[start:min(start + bs - 1, seq.num_tokens - 1)]
        manager = self.block_manager
        source, count = manager.continuation(parent, wanted) if wanted and self.kv is not None else (None, 0)
        if source is None:
            return 0
        manager.pin(source)  # the allocation below must not evict what it copies
        try:
            if not manager.can_allocate(seq, count):
                return 0
            target = manager.allocate(seq, count)[0]
            # Whole blocks: the tokens past `count` are overwritten before anyone reads them.
            self.kv.write_block(target, self.kv.read_block(source, self._slot(source)), self._slot(target))
        finally:
            manager.unpin(source)
        seq.num_computed_tokens = start + count
        manager.slide(seq)
        return count

    def admitted(self, seq: Sequence) -> None:
        """The scheduler admitted seq with the blocks attach() gave it: count the reuse once."""
        if seq.num_preemptions:
            return  # a recompute after preemption is not a new query
        bs = self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        c = self.counters
        c.prefix_query_tokens += seq.num_prompt_tokens
        c.prefix_hit_tokens_ram += seq.ram_blocks * bs + seq.partial_tokens
        c.prefix_hit_tokens_store += seq.store_blocks * bs
        if seq.num_cached_tokens:
            log.info("request %s: %d of %d prompt tokens from the prefix cache (%d from RAM, %d of them copied "
                     "from a block's first tokens; %d from the store)", seq.seq_id, seq.num_cached_tokens,
                     seq.num_prompt_tokens, seq.ram_blocks * bs + seq.partial_tokens, seq.partial_tokens,
                     seq.store_blocks * bs)

    def _restore(self, seq: Sequence, chain: list[bytes], start: int, usable: int) -> int:
        """Restore the run of stored blocks that follows the RAM prefix, if that beats recomputing."""
        bs = self.block_size
        run = 0
        while start + run < usable and self.store.contains(chain[start + run]):
            run += 1
        # Leave a block for the tokens fed after the prefix; the scheduler checks the rest.
        manager = self.block_manager
        run = min(run, manager.num_free_blocks - 1)
        if run <= 0:
            return 0
        nbytes = run * self.kv.block_payload_bytes
        if not self._worth_restoring(seq, run, nbytes):
            self.counters.prefix_recomputes += 1
            return 0
        self.counters.prefix_restores += 1
        started = self.clock()
        done = 0
        for i in range(start, start + run):
            seq.num_computed_tokens = i * bs
            if not manager.can_allocate(seq, bs):  # window slots ran out: recompute the rest
                break
            token_ids = seq.block_token_ids(i, bs)
            payload = self.store.get(chain[i], token_ids)
            if payload is None:  # evicted meanwhile, or found corrupt (and deleted): recompute from here
                # The rest of the run is recomputed too; dropping its stored copies lets the
                # fresh blocks replace them (the store keeps the first copy of a name).
                for name in chain[i + 1:start + run]:
                    self.store.delete(name)
                break
            block_id = manager.allocate(seq, bs)[0]
            self.kv.write_block(block_id, payload, self._slot(block_id))
            manager.register(block_id, chain[i], token_ids, self._parent(seq, chain, i))
            seq.num_computed_tokens = (i + 1) * bs
            manager.slide(seq)  # only the last window's worth of blocks keep their slots
            done += 1
        seconds = self.clock() - started
        moved = done * self.kv.block_payload_bytes
        self.restore_rate.observe(moved, seconds)
        if done:
            log.info("request %s: restored %d blocks (%d tokens, %.1f MB) from the prefix store in %.3f s (%.0f MB/s)",
                     seq.seq_id, done, done * bs, moved / 1e6, seconds, moved / 1e6 / max(seconds, 1e-9))
        return done

    def _worth_restoring(self, seq: Sequence, blocks: int, nbytes: int) -> bool:
        if self.restore_mode != "auto":
            return self.restore_mode == "always"
        tokens = blocks * self.block_size
        restore_s = self.restore_rate.seconds_for(nbytes)
        recompute_s = self.prefill_rate.seconds_for(tokens)
        if restore_s is None or recompute_s is None:
            log.info("request %s: restoring %d stored tokens (no measurement of both costs yet)", seq.seq_id, tokens)
            return True
        choice = restore_s < recompute_s
        log.info("request %s: %s %d stored tokens: restore %.3f s (%.0f MB/s measured) vs recompute %.3f s "
                 "(%.0f tokens/s measured)", seq.seq_id, "restoring" if choice else "recomputing", tokens,
                 restore_s, self.restore_rate.per_second / 1e6, recompute_s, self.prefill_rate.per_second)
        return choice

    # ---- after each step ------------------------------------------------------------------------

    def commit(self, seq: Sequence) -> None:
        """Name seq's newly full, computed blocks and send them to the store."""
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        if full <= seq.num_named_blocks:
            return
        chain = extend_chain(seq.block_hashes, seq.token_ids, bs, full, self.fingerprint,
                             namespace_root(seq.cache_namespace))
        writing = self.writer is not None and self.store.writes_enabled
        for i in range(seq.num_named_blocks, full):
            block_id = seq.block_table[i]
            token_ids = seq.block_token_ids(i, bs)
            self.block_manager.register(block_id, chain[i], token_ids, self._parent(seq, chain, i))
            if writing and not self.store.contains(chain[i]):
                self.writer.submit(chain[i], list(token_ids), self.kv.read_block(block_id, self._slot(block_id)))
        seq.num_named_blocks = full

    def release(self, seq: Sequence) -> None:
        """Free seq's blocks (it finished, was preempted or waits again), keeping the K/V of its
        last block's computed tokens when that block is partly computed: the next turn of a
        conversation, or the same prompt again, starts from them (see _copy_partial)."""
        bs = self.block_size
        full, extra = divmod(seq.num_computed_tokens, bs)
        if extra and full < len(seq.block_table) and seq.num_named_blocks == full:
            block_id = seq.block_table[full]
            manager = self.block_manager
            if manager.ref_count(block_id) == 1 and manager.block_hash(block_id) is None:
                chain = seq.block_hashes
                manager.register_partial(block_id, self._parent(seq, chain, full),
                                         tuple(seq.token_ids[full * bs:full * bs + extra]))
        self.block_manager.free(seq)

    @staticmethod
    def _parent(seq: Sequence, chain: list[bytes], index: int) -> bytes:
        """The name block `index` follows: the one before it, or its namespace's root."""
        return chain[index - 1] if index else namespace_root(seq.cache_namespace)

    def observe_step(self, prompt_tokens: int, seconds: float) -> None:
        """An engine step's prompt-chunk tokens and time, the recompute side of the cost model."""
        if prompt_tokens >= 4 * self.block_size:  # decode-sized steps say little about prefill
            self.prefill_rate.observe(prompt_tokens, seconds)

    def cached_prompt_tokens(self, seq: Sequence) -> int:
        """Prompt tokens at the start of seq that the RAM tier can give the next request now."""
        bs = self.block_size
        usable = min(seq.num_prompt_tokens // bs, len(seq.block_hashes))
        found = []
        for i in range(usable):
            block_id = self.block_manager.lookup(seq.block_hashes[i], seq.block_token_ids(i, bs))
            if block_id is None:
                break
            found.append(block_id)
        return self.block_manager.usable_prefix(found) * bs

    def snapshot(self) -> dict[str, int]:
        """Counters plus the store's size, under the heartbeat's field names."""
        out = dict(vars(self.counters))
        if self.store is not None:
            try:
                stats = self.store.stats()
            except Exception:  # the store must never take the heartbeat down
                log.debug("prefix store stats unavailable", exc_info=True)
            else:
                out.update(store_bytes=stats.bytes_used, store_evictions=stats.evictions, store_writes=stats.writes)
        return out

    def store_ticket(self) -> int:
        """A mark after every block handed to the store so far (see `store_reached`)."""
        return self.writer.ticket() if self.writer is not None else 0

    def store_reached(self, ticket: int) -> bool:
        """Whether the store is done with every block handed to it before `ticket` was taken."""
        return self.writer is None or self.writer.reached(ticket)

    def close(self, timeout: float = 10.0) -> None:
        """Let the writer commit what it holds (a worker leaving), then close the store."""
        if self.writer is not None:
            self.writer.close(timeout)
        if self.store is not None:
            self.store.close()

    # ---- which window slot holds a block's sliding-window layers (-1: none, or no window pool) -----

    def _slot(self, block_id: int) -> int:
        window = self.block_manager.window
        return -1 if window is None else int(window.slot_of[block_id])
