"""Leases in the node's store (memkv.server.store, docs/protocol.md section 11).

Behaviour under test:
* a leased value is never evicted: eviction under pressure takes unleased values (even more
  recently used ones) and, with nothing else left, a PUT answers NoSpace rather than evict it;
* a PUT of a leased key raises Leased and the leased bytes stay; a value leased while a PUT of
  its key was being received is not replaced at commit (commit returns False);
* a DELETE of a leased key answers LEASED: EXISTS and LEASE miss it at once, GET still serves
  the leased bytes, and the value is gone once its last lease ends (release or expiry);
* leases expire by themselves (an injected clock: no sleeping); renewal by the same token moves
  the expiry; tokens are independent (one holder's release does not end another's lease);
* bounds: the ttl is capped at max_lease_s; a lease beyond max_leases or max_lease_bytes answers
  MISS and is counted; accounting (leases, leased_bytes) returns to zero;
* each holder (token) may take at most max_lease_share of each bound: one holder at its share
  leaves the rest of the bound to others, renewals at the share still work, and what a holder
  releases or lets expire is its own to take again.
"""

from __future__ import annotations

import pytest

from memkv.protocol import ItemStatus
from memkv.server.store import Leased, NoSpace, Store
from tests.unit.test_store import SUM, MiB, put, read

pytestmark = pytest.mark.unit

OK, MISS, LEASED = ItemStatus.OK, ItemStatus.MISS, ItemStatus.LEASED


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store(capacity_mb: int = 4, **kwargs) -> tuple[Store, Clock]:
    clock = Clock()
    return Store(capacity_mb * MiB, clock=clock, **kwargs), clock


def test_eviction_under_pressure_skips_leased_values_even_the_least_recently_used():
    s, _ = store(4)
    for i in range(4):
        put(s, b"v%d" % i, bytes([i]) * MiB)
    statuses, lengths, _ = s.lease([b"v0"], token=1, ttl_s=60)  # v0 is the LRU value
    assert (statuses, lengths) == (bytes([OK]), [MiB])
    for i in range(4, 10):  # pressure: six more values through a 4-value store
        put(s, b"v%d" % i, bytes([i]) * MiB)
    assert read(s, b"v0") == bytes([0]) * MiB
    assert s.stats()["evictions"] == 6
    assert s.allocated_bytes <= s.capacity_bytes


def test_with_only_leased_values_left_a_put_answers_no_space_and_evicts_nothing():
    s, _ = store(2, max_lease_bytes=2 * MiB, max_lease_share=1.0)
    put(s, b"a", b"a" * MiB)
    put(s, b"b", b"b" * MiB)
    assert s.lease([b"a", b"b"], 1, 60)[0] == bytes([OK, OK])
    with pytest.raises(NoSpace, match="leased"):
        put(s, b"c", b"c" * MiB)
    assert read(s, b"a") == b"a" * MiB and read(s, b"b") == b"b" * MiB


def test_put_of_a_leased_key_is_refused_and_the_leased_bytes_stay():
    s, _ = store()
    put(s, b"k", b"old" * 1000)
    s.lease([b"k"], 1, 60)
    with pytest.raises(Leased):
        put(s, b"k", b"new" * 1000)
    assert read(s, b"k") == b"old" * 1000
    assert s.inflight_bytes == 0


def test_a_value_leased_while_its_replacement_is_received_is_not_replaced_at_commit():
    s, _ = store()
    put(s, b"k", b"old")
    ticket = s.begin_put(b"k", 3, 1, SUM)
    ticket.target[:] = b"new"
    s.lease([b"k"], 1, 60)
    assert s.commit(ticket) is False
    assert read(s, b"k") == b"old"
    assert s.inflight_bytes == 0
    assert s.allocated_bytes - s.stats()["pooled_bytes"] == 3  # the refused buffer went back to the pool


def test_delete_of_a_leased_key_is_deferred_until_its_last_lease_ends():
    s, clock = store()
    put(s, b"k", b"bytes")
    s.lease([b"k"], 1, 10)
    s.lease([b"k"], 2, 60)
    assert s.delete([b"k"]) == bytes([LEASED])
    assert s.exists([b"k"]) == bytes([MISS])
    assert s.lease([b"k"], 3, 60)[0] == bytes([MISS])  # no new holder finds it
    assert read(s, b"k") == b"bytes"  # the holders still read the leased bytes
    assert s.list_keys()[0] == []
    assert s.end_leases([b"k"], 1) == bytes([OK])
    assert read(s, b"k") == b"bytes"  # token 2 still holds it
    clock.now += 61  # token 2's lease expires
    assert s.stats()["leases"] == 0
    assert read(s, b"k") is None
    assert s.stats()["lease_expirations"] == 1
    assert s.leased_bytes == 0 and s.stored_bytes == 0


def test_leases_expire_and_renewal_by_the_same_token_moves_the_expiry():
    s, clock = store()
    put(s, b"k", b"x")
    s.lease([b"k"], 7, 10)
    clock.now += 8
    s.lease([b"k"], 7, 10)  # renewed: now expires at +18
    clock.now += 8
    assert s.stats()["leases"] == 1
    with pytest.raises(Leased):
        put(s, b"k", b"y")
    clock.now += 3
    assert s.stats()["leases"] == 0
    put(s, b"k", b"y")  # no lease: the overwrite goes through
    assert read(s, b"k") == b"y"


def test_tokens_are_independent_and_release_of_an_unknown_lease_misses():
    s, _ = store()
    put(s, b"k", b"x")
    s.lease([b"k"], 1, 60)
    assert s.end_leases([b"k"], 2) == bytes([MISS])
    assert s.end_leases([b"nope"], 1) == bytes([MISS])
    assert s.stats()["leases"] == 1
    assert s.end_leases([b"k"], 1) == bytes([OK])
    assert s.stats()["leases"] == 0 and s.leased_bytes == 0


def test_ttl_is_capped_and_leases_beyond_the_count_or_byte_bound_answer_miss():
    s, clock = store(8, max_lease_s=5.0, max_leases=3, max_lease_bytes=2 * MiB, max_lease_share=1.0)
    for i in range(4):
        put(s, b"v%d" % i, bytes([i]) * MiB)
    statuses, lengths, ttl = s.lease([b"v0", b"v1", b"v2"], 1, 3600)
    assert ttl == 5.0
    assert statuses == bytes([OK, OK, MISS])  # the third would exceed 2 MiB of leased values
    assert lengths == [MiB, MiB, 0]
    assert s.lease([b"v0"], 2, 60)[0] == bytes([OK])  # same value, another holder: no new bytes
    assert s.lease([b"v1"], 2, 60)[0] == bytes([MISS])  # a 4th lease: over max_leases
    assert s.lease([b"v0"], 1, 60)[0] == bytes([OK])  # a renewal is never refused
    assert s.stats()["leases_refused"] == 2
    clock.now += 6
    stats = s.stats()
    assert stats["leases"] == 0 and stats["leased_bytes"] == 0


def test_one_holder_takes_at_most_its_share_of_the_bounds_and_leaves_the_rest_to_others():
    s, clock = store(16, max_leases=8, max_lease_bytes=8 * MiB, max_lease_share=0.5)
    for i in range(10):
        put(s, b"v%d" % i, bytes([i]) * MiB)
    size = s._index[b"v0"].buf.size  # one value's buffer: what a lease of it is charged
    per_holder = (4 * MiB) // size
    first = s.lease([b"v%d" % i for i in range(10)], 1, 60)[0]
    assert first.count(OK) == per_holder and first[:per_holder] == bytes([OK]) * per_holder
    assert s.lease([b"v0"], 1, 60)[0] == bytes([OK]), "a renewal at the share is never refused"
    second = s.lease([b"v%d" % i for i in range(10)], 2, 60)[0]
    assert second.count(OK) == per_holder, "the other holder gets the rest of the bound"
    stats = s.stats()
    assert stats["lease_holders"] == 2 and stats["leases_refused"] == 2 * (10 - per_holder)
    assert s.end_leases([b"v0"], 1) == bytes([OK])
    assert s.lease([b"v%d" % per_holder], 1, 60)[0] == bytes([OK]), "a released lease is the holder's to use again"
    clock.now += 61
    stats = s.stats()
    assert stats["leases"] == 0 and stats["leased_bytes"] == 0 and stats["lease_holders"] == 0


def test_the_share_bounds_a_holders_lease_count_too():
    s, _ = store(4, max_leases=4, max_lease_share=0.25)
    for i in range(3):
        put(s, b"k%d" % i, b"x" * 100)
    assert s.lease([b"k0", b"k1"], 1, 60)[0] == bytes([OK, MISS])
    assert s.lease([b"k1"], 2, 60)[0] == bytes([OK])


def test_a_share_outside_zero_to_one_is_refused():
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="max_lease_share"):
            Store(MiB, max_lease_share=share)
