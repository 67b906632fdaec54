"""Writes to the prefix store on one daemon thread (shared.write_behind), so the request path
never waits on disk.

Operations run in submission order. Consecutive puts become one `put_many` transaction (one
commit, one fsync) of at most `_MAX_BATCH_BYTES`; compression happens there, on this thread;
consecutive touches become one. `submit` never blocks: when the queue already holds
`max_pending_bytes` of payload the block is dropped (counted in `dropped`).

`flush` (blocking) and `ticket`/`reached` (polling) count operations, whether the store committed
them or refused them (writes stopped, entry over budget).
"""
from __future__ import annotations

import logging

from shared.write_behind import WriteBehind
from worker.kv.store import KVStore, check_key

log = logging.getLogger("reame.kvstore")

# One transaction holds the host-wide LMDB write lock; other workers' writes wait for it.
_MAX_BATCH_BYTES = 8 << 20


class StoreWriter(WriteBehind[tuple]):
    """flush, ticket, reached and close are WriteBehind's; close leaves the store open (its owner closes it)."""

    def __init__(self, store: KVStore, max_pending_bytes: int = 256 << 20):
        self.store = store
        # ("put", key, token_ids, payload) | ("touch", keys) | ("delete", key)
        super().__init__(self._write, name="reame-kvstore-writer", what="prefix store", log=log, joins=_joins,
                         max_pending_bytes=max_pending_bytes)

    def submit(self, key: bytes, token_ids: list[int], payload: bytes) -> bool:
        """Queues one block for writing; False when closed or (counted in `dropped`) the queue is full."""
        check_key(key)
        if not isinstance(payload, bytes):
            payload = bytes(payload)  # the caller's KV block may be reused before the write runs
        return self.enqueue(("put", key, list(token_ids), payload), len(payload))

    def touch(self, keys: list[bytes]) -> None:
        keys = list(keys)
        for key in keys:
            check_key(key)
        if keys:
            self.enqueue(("touch", keys))

    def delete(self, key: bytes) -> None:
        check_key(key)
        self.enqueue(("delete", key))

    def _write(self, batch: list[tuple]) -> None:
        kind = batch[0][0]
        if kind == "put":
            self.store.put_many([(key, token_ids, payload) for _, key, token_ids, payload in batch])
        elif kind == "touch":
            self.store.touch([key for _, keys in batch for key in keys])
        else:
            self.store.delete(batch[0][1])


def _joins(batch: list[tuple], op: tuple) -> bool:
    """Puts share a transaction up to _MAX_BATCH_BYTES, touches always, a delete runs alone."""
    kind = batch[0][0]
    if op[0] != kind or kind == "delete":
        return False
    return kind == "touch" or sum(len(o[3]) for o in batch) + len(op[3]) <= _MAX_BATCH_BYTES
