"""One daemon thread that applies a store's writes behind the request path, in submission order.

`enqueue` never blocks: past `max_pending_bytes` of payload or `max_pending_ops` operations queued,
an operation is dropped (counted in `dropped`): a cache may forget, a request must not stall.
The thread takes the head operation and the ones after it that `joins` lets into the same
batch, and hands the batch to `apply` (one transaction, one commit). It runs at the lowest CPU
priority (shared.thread_priority). An exception in `apply` is logged and the thread goes on with
the next batch.

`flush` (blocking) and `ticket`/`reached` (polling) count operations: the thread has caught up
with a mark once it is done with everything queued before it, applied or refused.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Generic, TypeVar

from shared.thread_priority import lower_this_thread

Op = TypeVar("Op")


class WriteBehind(Generic[Op]):
    def __init__(self, apply: Callable[[list[Op]], None], *, name: str, what: str, log: logging.Logger,
                 joins: Callable[[list[Op], Op], bool] = lambda batch, op: True,
                 max_pending_bytes: int | None = None, max_pending_ops: int | None = None):
        self.dropped = 0
        self.pending_bytes = 0
        self._apply = apply
        self._joins = joins
        self._what = what  # names the store in log lines
        self._log = log
        self._max_bytes = max_pending_bytes
        self._max_ops = max_pending_ops
        self._ops: deque[tuple[Op, int]] = deque()  # (operation, its payload bytes), oldest first
        self._cond = threading.Condition()
        self._submitted = 0
        self._finished = 0
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def enqueue(self, op: Op, size: int = 0) -> bool:
        """Queues op (size: its payload bytes); False when closed, or full (counted in `dropped`)."""
        with self._cond:
            if self._closing:
                return False
            if ((self._max_bytes is not None and self.pending_bytes + size > self._max_bytes)
                    or (self._max_ops is not None and len(self._ops) >= self._max_ops)):
                self.dropped += 1
                return False
            self._ops.append((op, size))
            self.pending_bytes += size
            self._submitted += 1
            self._cond.notify_all()
        return True

    def flush(self, timeout: float) -> bool:
        """True when everything enqueued before this call has been applied (or refused)."""
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._finished >= target, timeout)

    def ticket(self) -> int:
        """A mark after everything enqueued so far: `reached(ticket)` tells, without waiting,
        whether all of it has been applied (or refused)."""
        with self._cond:
            return self._submitted

    def reached(self, ticket: int) -> bool:
        with self._cond:
            return self._finished >= ticket

    def close(self, timeout: float = 10.0) -> None:
        """Flushes (up to timeout), then stops the thread."""
        deadline = time.monotonic() + timeout
        if not self.flush(timeout):
            self._log.warning("%s writer: %d operations (%d bytes) still pending after %.1f s at close",
                              self._what, len(self._ops), self.pending_bytes, timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        lower_this_thread()  # the engine's threads come first (shared.thread_priority)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._ops or self._closing)
                if not self._ops:
                    return
                batch, size = self._take_batch()
            try:
                self._apply(batch)
            except Exception:
                self._log.exception("%s writer: a batch of %d operations failed; continuing", self._what, len(batch))
            finally:
                with self._cond:
                    self._finished += len(batch)
                    self.pending_bytes -= size
                    self._cond.notify_all()

    def _take_batch(self) -> tuple[list[Op], int]:
        """The head operation plus the following ones `joins` lets share its transaction, and their bytes."""
        op, size = self._ops.popleft()
        batch = [op]
        while self._ops and self._joins(batch, self._ops[0][0]):
            op, more = self._ops.popleft()
            batch.append(op)
            size += more
        return batch, size
