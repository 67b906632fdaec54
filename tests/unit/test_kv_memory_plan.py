"""The worker's start-up memory line, and the refusal of a KV pool the host cannot hold."""
from __future__ import annotations

import pytest

from shared.errors import ConfigError
from worker.engine.paged_kv import memory_plan

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
