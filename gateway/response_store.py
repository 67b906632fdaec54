"""Stored responses of the OpenAI Responses API (`store: true`), per API key, kept across restarts.

One SQLite file, `[gateway] stored_responses_path` (by default `<[server] state_dir>/responses.sqlite`). SQLite rather than LMDB (which holds
the prefix store): the records are small JSON documents looked up by (owner, id), listed by
age for retention, and deleted one by one or in ranges; SQLite does that with an index and a
transaction per write, needs no map size chosen up front, and gateways on one host can share
the file (WAL mode). LMDB's strength, large values read without a copy, does not matter here.

Every row has an owner: the SHA-256 of the API key that created it ("" on a server without
keys). Every read, delete and listing is by (owner, id), so one tenant never reads, continues
or deletes another's responses; a foreign id looks exactly like a missing one.

Retention ([gateway] in reame.conf): a response older than `stored_response_hours` is deleted,
and an owner keeps at most `stored_responses_per_key`, the oldest going first. Both are applied
on every write. Calls block (a few ms each): the handlers run them on a thread.
"""
from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    owner TEXT NOT NULL,
    id TEXT NOT NULL,
    created REAL NOT NULL,
    response BLOB NOT NULL,      -- the response object, as GET /v1/responses/{id} answers it
    input_items BLOB NOT NULL,   -- its input items, as GET /v1/responses/{id}/input_items lists them
    conversation BLOB NOT NULL,  -- chat messages of the whole conversation to here (no instructions)
    PRIMARY KEY (owner, id)
);
CREATE INDEX IF NOT EXISTS responses_age ON responses (owner, created);
"""


@dataclass(frozen=True)
class StoredResponse:
    id: str
    created: float
    response: dict
    input_items: list
    conversation: list


class ResponseStore:
    def __init__(self, path: Path, max_age_hours: float, max_per_owner: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_age_s = max_age_hours * 3600.0
        self.max_per_owner = max_per_owner
        self._lock = threading.Lock()  # one connection, used from the handlers' threads one at a time
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=10)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(SCHEMA)

    def put(self, owner: str, stored: StoredResponse, now: float | None = None) -> None:
        now = time.time() if now is None else now
        row = (owner, stored.id, stored.created, orjson.dumps(stored.response), orjson.dumps(stored.input_items),
               orjson.dumps(stored.conversation))
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)", row)
                self._db.execute("DELETE FROM responses WHERE created < ?", (now - self.max_age_s,))
                self._db.execute("DELETE FROM responses WHERE owner = ? AND id IN (SELECT id FROM responses "
                                 "WHERE owner = ? ORDER BY created DESC LIMIT -1 OFFSET ?)",
                                 (owner, owner, self.max_per_owner))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def get(self, owner: str, response_id: str, now: float | None = None) -> StoredResponse | None:
        now = time.time() if now is None else now
        with self._lock:
            row = self._db.execute("SELECT id, created, response, input_items, conversation FROM responses "
                                   "WHERE owner = ? AND id = ? AND created >= ?",
                                   (owner, response_id, now - self.max_age_s)).fetchone()
        if row is None:
            return None
        return StoredResponse(row[0], row[1], orjson.loads(row[2]), orjson.loads(row[3]), orjson.loads(row[4]))

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            cursor = self._db.execute("DELETE FROM responses WHERE owner = ? AND id = ?", (owner, response_id))
        return cursor.rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()
