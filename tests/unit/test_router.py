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


def on(host: str, *ids: str, active: int = 0) -> list[Candidate]:
    return [Candidate(i, active, 4, host) for i in ids]


def test_a_busy_holder_yields_to_a_worker_on_its_host():
    """The host's store holds the prefix: restoring it there beats recomputing it elsewhere."""
    router = Router()
    key = prefix_key([7, 8])
    assert router.choose(on("h1", "a1") + on("h2", "b1"), key) == "a1"
    assert router.choose(on("h2", "b1", "b2") + on("h1", "a2"), prefix_key([99])) == "a2"
    busy = [Candidate("a1", 2, 4, "h1")] + on("h1", "a2") + on("h2", "b1", "b2")
    assert router.choose(busy, key) == "a2"  # not b1, though b1 was used less recently


def test_a_worker_that_left_leaves_its_host_preferred():
    router = Router()
    key = prefix_key([3])
    assert router.choose(on("h1", "a1") + on("h2", "b1"), key) == "a1"
    router.forget("a1")  # a restart: a new worker on h1 finds the prefix in the host's store
    assert router.choose(on("h2", "b1") + on("h1", "a9"), key) == "a9"


def test_host_preference_never_outweighs_load():
    router = Router()
    key = prefix_key([4])
    router.choose(on("h1", "a1") + on("h2", "b1"), key)
    busier = [Candidate("a1", 3, 4, "h1"), Candidate("a2", 1, 4, "h1"), Candidate("b1", 0, 4, "h2")]
    assert router.choose(busier, key) == "b1"


def test_unknown_hosts_are_not_one_host():
    router = Router()
    key = prefix_key([6])
    router.choose(idle("a", "b"), key)
    router.forget("a")
    assert key not in router._affinity  # no host to remember it by


def test_least_loaded_routing_ignores_prefixes():
    router = Router(affinity=False)
    key = prefix_key([5])
    picks = [router.choose(on("h1", "a") + on("h2", "b"), key) for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]
