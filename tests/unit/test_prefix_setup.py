"""build_prefix_cache from reame.conf: a store that cannot be opened leaves the RAM tier, said loudly."""
from __future__ import annotations

import logging
from types import SimpleNamespace

from shared.config import parse_config
from worker.kv import prefix_setup
from worker.kv.block_manager import BlockManager


def fake_engine():
    return SimpleNamespace(kv=SimpleNamespace(block_payload_bytes=4096, dtype="float16"))


def test_a_store_path_that_cannot_be_written_is_a_warning_naming_path_and_setting(monkeypatch, caplog):
    # /proc refuses a mkdir even to root, as ProtectHome= or a read-only tree refuses the service.
    config = parse_config("[prefix_cache]\nstore_path = /proc/reame-store/kv\n")
    monkeypatch.setattr(prefix_setup, "engine_fingerprint", lambda engine: b"\0" * 32)
    with caplog.at_level(logging.INFO, "reame.prefix"):
        cache = prefix_setup.build_prefix_cache(config, fake_engine(), BlockManager(8, 16))
    assert cache is not None and cache.store is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "/proc/reame-store/kv" in warnings[0].getMessage()
    assert "[prefix_cache] store_path" in warnings[0].getMessage()
    assert "prefix cache: on (RAM only" in caplog.text
