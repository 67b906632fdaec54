"""The worker's prefix cache from reame.conf: the K/V fingerprint, the host store, its writer."""
from __future__ import annotations

import logging

from shared.config import Config, memory_bytes
from shared.hashing import kv_fingerprint
from worker.kv.block_manager import BlockManager
from worker.kv.prefix_cache import PrefixCache

log = logging.getLogger("reame.prefix")

def engine_fingerprint(engine) -> bytes:
    """Everything that changes the K/V bytes a block holds: a stored block computed under any
    other setup is not served (its hash chain differs)."""
    from worker.engine import SOURCE_DIGEST
    return kv_fingerprint(model_sha256=engine.gguf.fingerprint(), arch=engine.arch, kv_dtype=engine.kv.dtype,
                          block_size=engine.kv.block_size, kv_layout=engine.kv.layout, kernels=engine.kernels,
                          int8_activations=engine.ops.numerics("matmul") == "int8", engine_code=SOURCE_DIGEST)


def build_prefix_cache(config: Config, engine, blocks: BlockManager) -> PrefixCache | None:
    """The prefix cache reame.conf asks for, naming blocks of `blocks` (the generator's manager)."""
    settings = config.prefix_cache
    if not settings.enabled:
        log.info("prefix cache: off ([prefix_cache] enabled = false)")
        return None
    fingerprint = engine_fingerprint(engine)
    store = writer = None
    if settings.store_path:
        from worker.kv.store import KVStore, KVStoreUnavailable
        from worker.kv.store_writer import StoreWriter

        path = config.resolve_path(settings.store_path)
        budget = memory_bytes(settings.store_budget, 1, "[prefix_cache] store_budget")
        payload = engine.kv.block_payload_bytes
        try:
            store = KVStore(path, fingerprint=fingerprint, payload_bytes=payload, budget_bytes=budget,
                            dtype=engine.kv.dtype if "," not in engine.kv.dtype else "mixed", compression=settings.store_compression)
        except KVStoreUnavailable as exc:
            # Typically a path the service may not write (systemd's ProtectHome= hides ~): without
            # this line the host store, and all it saves across restarts, is silently gone.
            log.warning("prefix store unavailable (%s): prefixes are reused from RAM only and lost on restart; "
                        "set [prefix_cache] store_path (now %r) to a writable directory, or to \"\" for RAM only",
                        exc, settings.store_path)
        else:
            writer = StoreWriter(store)
            stats = store.stats()
            log.info("prefix store %s: %d blocks, %.1f of %.1f MiB (%s, %d KiB per block before compression)",
                     path, stats.entries, stats.bytes_used / 2**20, budget / 2**20, settings.store_compression,
                     payload >> 10)
    log.info("prefix cache: on (RAM%s; restore %s; fingerprint %s)", " + store" if store else " only",
             settings.store_restore, fingerprint.hex()[:16])
    return PrefixCache(blocks, fingerprint, kv=engine.kv, store=store, writer=writer,
                       restore=settings.store_restore)
