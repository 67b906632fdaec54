"""Writes to the prefix store on one daemon thread, so the request path never waits on disk.

Operations run in submission order. Consecutive puts become one `put_many` transaction (one
commit, one fsync) of at most `_MAX_BATCH_BYTES`; compression happens there, on this thread.
`submit` never blocks: when the queue already holds `max_pending_bytes` of payload the block is
dropped (counted in `dropped`) — a cache may forget, the request must not stall.

`flush` (blocking) and `ticket`/`reached` (polling) count operations: `_finished` catches up with
`_submitted` when the thread is done with everything queued before, whether the store committed it
or refused it (writes stopped, entry over budget). An exception in the thread is logged and the thread goes on with the next operation.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

from shared.thread_priority import lower_this_thread
from worker.kv.store import KVStore, check_key

log = logging.getLogger("reame.kvstore")

# One transaction holds the host-wide LMDB write lock; other workers' writes wait for it.
_MAX_BATCH_BYTES = 8 << 20


class StoreWriter:
    def __init__(self, store: KVStore, max_pending_bytes: int = 256 << 20):
        self.store = store
        self.max_pending_bytes = max_pending_bytes
        self.dropped = 0
        self.pending_bytes = 0
        # ("put", key, token_ids, payload) | ("touch", keys) | ("delete", key), oldest first
        self._ops: deque[tuple] = deque()
        self._cond = threading.Condition()
        self._submitted = 0
        self._finished = 0
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="reame-kvstore-writer", daemon=True)
        self._thread.start()

    def submit(self, key: bytes, token_ids: list[int], payload: bytes) -> bool:
        """Queues one block for writing; False (and counted in `dropped`) when the queue is full."""
        check_key(key)
        if not isinstance(payload, bytes):
            payload = bytes(payload)  # the caller's KV block may be reused before the write runs
        with self._cond:
            if self._closing:
                return False
            if self.pending_bytes + len(payload) > self.max_pending_bytes:
                self.dropped += 1
                return False
            self._enqueue(("put", key, list(token_ids), payload), len(payload))
        return True

    def touch(self, keys: list[bytes]) -> None:
        keys = list(keys)
        for key in keys:
            check_key(key)
        with self._cond:
            if keys and not self._closing:
                self._enqueue(("touch", keys), 0)

    def delete(self, key: bytes) -> None:
        check_key(key)
        with self._cond:
            if not self._closing:
                self._enqueue(("delete", key), 0)

    def flush(self, timeout: float) -> bool:
        """True when everything submitted before this call has been written (or refused)."""
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._finished >= target, timeout)

    def ticket(self) -> int:
        """A mark after everything submitted so far: `reached(ticket)` tells, without waiting,
        whether all of it has been written (or refused)."""
        with self._cond:
            return self._submitted

    def reached(self, ticket: int) -> bool:
        with self._cond:
            return self._finished >= ticket

    def close(self, timeout: float = 10.0) -> None:
        """Flushes, then stops the thread. The store itself stays open: its owner closes it."""
        deadline = time.monotonic() + timeout
        if not self.flush(timeout):
            log.warning("prefix store writer: %d bytes still pending after %.1f s at close",
                        self.pending_bytes, timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))

    # ---- the thread ----------------------------------------------------------------------------

    def _enqueue(self, op: tuple, size: int) -> None:
        self._ops.append(op)
        self.pending_bytes += size
        self._submitted += 1
        self._cond.notify_all()

    def _run(self) -> None:
        lower_this_thread()  # the engine's threads come first (shared.thread_priority)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._ops or self._closing)
                if not self._ops:
                    return
                batch = self._take_batch()
            try:
                self._apply(batch)
            except Exception:
                log.exception("prefix store writer: a %s of %d operations failed; continuing",
                              batch[0][0], len(batch))
            finally:
                with self._cond:
                    self._finished += len(batch)
                    self.pending_bytes -= sum(len(op[3]) for op in batch if op[0] == "put")
                    self._cond.notify_all()

    def _take_batch(self) -> list[tuple]:
        """The head operation plus the following ones of the same kind that can share its transaction."""
        batch = [self._ops.popleft()]
        kind = batch[0][0]
        if kind == "put":
            size = len(batch[0][3])
            while self._ops and self._ops[0][0] == "put" and size + len(self._ops[0][3]) <= _MAX_BATCH_BYTES:
                size += len(self._ops[0][3])
                batch.append(self._ops.popleft())
        elif kind == "touch":
            while self._ops and self._ops[0][0] == "touch":
                batch.append(self._ops.popleft())
        return batch

    def _apply(self, batch: list[tuple]) -> None:
        kind = batch[0][0]
        if kind == "put":
            self.store.put_many([(key, token_ids, payload) for _, key, token_ids, payload in batch])
        elif kind == "touch":
            self.store.touch([key for _, keys in batch for key in keys])
        else:
            self.store.delete(batch[0][1])
