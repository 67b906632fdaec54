"""The worker's start-up memory line, the refusal of a KV pool the host cannot hold, and the bytes
of the pool that requests hold (/metrics)."""
from __future__ import annotations

import pytest

from shared.errors import ConfigError
from worker.engine.paged_kv import KVShape, PagedKVCache, WindowLayout, memory_plan

MIB = 2 ** 20


def test_names_weights_pool_and_spare():
    line = memory_plan(300 * MIB, 1024 * MIB, 4096 * MIB, "float16")
    assert line == "memory: weights 300 MiB, KV pool 1024 MiB (float16), 3072 MiB spare of 4096 MiB available"


def test_a_pool_over_available_memory_is_refused_with_numbers_and_keys():
    with pytest.raises(ConfigError) as err:
        memory_plan(1500 * MIB, 8192 * MIB, 2000 * MIB, "float16")
    msg = err.value.message
    for part in ("8192 MiB", "2000 MiB", "1500 MiB", "kv_cache_memory", "context_length", "kv_dtype = q8_0"):
        assert part in msg


def test_held_bytes_are_blocks_and_window_slots_of_the_pool():
    shape = KVShape(n_layers=3, n_kv_heads=2, head_dim=32, block_size=16)
    kv = PagedKVCache(shape, num_blocks=10, dtype="float16")
    assert kv.held_bytes(3) == 3 * shape.block_bytes("float16") and kv.held_bytes(10) == kv.nbytes
    # Layer 1 keeps its K/V in 4 window slots: a held block costs the main pool 2 layers, a slot 1.
    windowed = PagedKVCache(shape, num_blocks=10, dtype="float16", window=WindowLayout((1,), 32, 4))
    assert windowed.held_bytes(3, 2) == 3 * shape.block_bytes("float16", 2) + 2 * shape.block_bytes("float16", 1)
    assert windowed.held_bytes(10, 4) == windowed.nbytes
