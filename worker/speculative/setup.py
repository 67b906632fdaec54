"""The worker's speculator from reame.conf: on or off, its draft length, the archive and its store."""
from __future__ import annotations

import logging

from shared.config import Config, memory_bytes
from worker.speculative.archive import ORDER, NgramArchive
from worker.speculative.speculator import Speculator

log = logging.getLogger("reame.spec")


def build_speculator(config: Config, model_sha256: str) -> tuple[Speculator | None, object | None]:
    """(the speculator, the archive store to close at exit) as [speculative] and [tuning] ask;
    (None, None) when speculation is off. model_sha256: the model file's, naming its n-grams."""
    settings = config.speculative
    if not config.speculation:
        why = "[tuning] adaptive = false" if not config.tuning.adaptive else "[speculative] enabled = off"
        log.info("speculative decoding: off (%s)", why)
        return None, None
    if settings.max_draft < 1:
        from shared.errors import ConfigError
        raise ConfigError(f"[speculative] max_draft must be at least 1, got {settings.max_draft}")
    store = None
    if settings.archive_path:
        from worker.speculative.archive_store import ArchiveStore, ArchiveUnavailable

        path = config.resolve_path(settings.archive_path)
        budget = memory_bytes(settings.archive_budget, 1, "[speculative] archive_budget")
        try:
            store = ArchiveStore(path, model=bytes.fromhex(model_sha256), order=ORDER, budget_bytes=budget)
        except ArchiveUnavailable as exc:
            log.warning("%s: drafts come from prompts and this worker's completions only", exc)
        else:
            stats = store.stats()
            log.info("n-gram archive %s: %d contexts, %.1f of %.1f MiB", path, stats["entries"],
                     stats["bytes_used"] / 2**20, budget / 2**20)
    speculator = Speculator(max_draft=settings.max_draft, archive=NgramArchive(backing=store), memory=store)
    log.info("speculative decoding: on (up to %d drafted tokens; prompt lookup, archive %s)", settings.max_draft,
             "in RAM and on disk" if store is not None else "in RAM only")
    return speculator, store
