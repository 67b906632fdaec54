"""Routing: prefix affinity first, then the least loaded, least recently used worker."""
from __future__ import annotations

import pytest

from gateway.router import PREFIX_TOKENS, Candidate, Router, prefix_key


def idle(*ids):
    return [Candidate(i, 0, 1) for i in ids]


def test_prefix_key_is_stable_and_uses_the_head_only():
    a = list(range(PREFIX_TOKENS)) + [1, 2, 3]
    b = list(range(PREFIX_TOKENS)) + [9]
    assert prefix_key(a) == prefix_key(b)
    assert prefix_key([1, 2]) != prefix_key([1, 3])
    # Fixed value: the key must not depend on the process (no salted hash()).
    assert prefix_key([1, 2, 3]).hex() == prefix_key([1, 2, 3]).hex()


def test_idle_workers_share_a_burst():
    router = Router()
    picks = [router.choose(idle("a", "b", "c"), prefix_key([i])) for i in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_same_prefix_goes_back_to_the_same_worker():
    router = Router()
    key = prefix_key([5, 6, 7])
    first = router.choose(idle("a", "b"), key)
    router.choose(idle("a", "b"), prefix_key([1]))
    assert router.choose(idle("a", "b"), key) == first


def test_affinity_yields_to_load():
    router = Router()
    key = prefix_key([5])
    assert router.choose(idle("a", "b"), key) == "a"
    busy = [Candidate("a", 1, 2), Candidate("b", 0, 2)]
    assert router.choose(busy, key) == "b"


def test_least_loaded_wins():
    router = Router()
    cands = [Candidate("a", 3, 4), Candidate("b", 1, 4), Candidate("c", 2, 4)]
    assert router.choose(cands, prefix_key([1])) == "b"


def test_forgotten_worker_loses_its_affinity():
    router = Router()
    key = prefix_key([5])
    assert router.choose(idle("a", "b"), key) == "a"
    router.forget("a")
    assert router.choose(idle("b"), key) == "b"
    assert router.choose(idle("a", "b"), key) == "b"


def test_affinity_table_is_bounded():
    router = Router(max_entries=3)
    for i in range(10):
        router.choose(idle("a"), prefix_key([i]))
    assert len(router._affinity) == 3


def test_no_candidates_is_a_bug():
    with pytest.raises(ValueError):
        Router().choose([], b"")
