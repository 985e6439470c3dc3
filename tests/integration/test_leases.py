"""LEASE / RELEASE against real `memkv serve` processes, through the real client.

Behaviour under test:
* `Client.lease` answers per key across nodes (HRW owners), True only for stored values; a
  leased value survives memory pressure that evicts everything else, and is evictable again
  once released;
* a leased value cannot be overwritten (PUT answers False, the leased bytes stay) or deleted
  (DELETE answers False, EXISTS and LEASE, renewals included, miss it at once, GET still serves
  the leased bytes, and it is gone once released);
* leases expire by themselves: the node caps the ttl (`--max-lease-ttl`, reported by `lease_on`)
  and the lease count falls to 0 on the node's metrics without a release;
* bounds: with `--max-lease-bytes` a lease beyond the bound answers False and is counted; one
  holder (client) takes at most its share (`--max-lease-share`) of it, so another holder still
  gets the rest, and with leases at their bound a third client's PUTs still store (evicting
  unleased values);
* a node restart drops its leases (and values); a killed node's keys answer False within the
  client's timeout, as `exists` does; `timeout_s` bounds the wait for a stopped node.

Every wait is a deadline-bounded poll (tests/conftest.py poll_until) or a client timeout.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.faults.nodeops import metric_value, metrics_of, restart_empty

pytestmark = pytest.mark.integration

MiB = 1 << 20


def _keys_on(client, node, prefix: str, n: int) -> list[bytes]:
    keys = [f"{prefix}/{i}".encode() for i in range(2000)]
    return [k for k in keys if client.owner(k).name == node.address][:n]


def test_leased_value_survives_pressure_that_evicts_everything_else_until_released(start_node, make_client):
    node = start_node(capacity="8MiB", extra_args=["--max-value-size", "2MiB"])
    client = make_client([node])
    client.put(b"leased", b"L" * MiB)
    assert client.lease([b"leased", b"absent"], ttl_s=60) == [True, False]
    for i in range(24):  # 3x the capacity, the leased value the least recently written
        client.put(b"fill/%d" % i, bytes([i]) * MiB)
    assert client.get(b"leased") == b"L" * MiB
    assert metric_value(metrics_of(node), "memkv_node_leased_bytes") >= MiB
    assert client.release([b"leased"]) == [True]
    for i in range(24, 40):
        client.put(b"fill/%d" % i, bytes([i]) * MiB)
    assert client.get(b"leased") is None  # evictable again


def test_leased_value_is_not_overwritten_and_its_delete_waits_for_the_release(start_node, make_client):
    nodes = start_node.many(2)
    client = make_client(nodes)
    keys = [k for n in nodes for k in _keys_on(client, n, "ow", 2)]
    client.batch_put_views([(k, b"old:" + k) for k in keys])
    assert client.lease(keys, ttl_s=60) == [True] * len(keys)
    assert client.batch_put_views([(k, b"new:" + k) for k in keys]) == [False] * len(keys)
    assert [client.get(k) for k in keys] == [b"old:" + k for k in keys]
    assert client.delete(keys) == [False] * len(keys)
    assert client.exists(keys) == [False] * len(keys)
    assert client.lease(keys, ttl_s=60) == [False] * len(keys)  # deleted: not renewed (goes within one ttl)
    assert [client.get(k) for k in keys] == [b"old:" + k for k in keys]  # the leased bytes
    assert client.release(keys) == [True] * len(keys)
    assert [client.get(k) for k in keys] == [None] * len(keys)  # deferred delete done


def test_leases_expire_by_themselves_at_the_nodes_ttl_cap(start_node, make_client, wait_until):
    node = start_node(extra_args=["--max-lease-ttl", "0.3"])
    client = make_client([node])
    client.put(b"k", b"v")
    reply = client.lease_on(node.address, [b"k", b"gone"], ttl_s=60)
    assert reply.ttl_ms == 300
    assert list(reply.lengths) == [1, 0]
    wait_until(lambda: metric_value(metrics_of(node), "memkv_node_leases") == 0, 20, what="lease expiry")
    assert metric_value(metrics_of(node), "memkv_node_lease_expirations_total") >= 1
    client.put(b"k", b"w")  # no lease left: the overwrite goes through
    assert client.get(b"k") == b"w"


def test_lease_beyond_the_byte_bound_answers_false_and_is_counted(start_node, make_client):
    # One holder may take the whole bound here (--max-lease-share 1): the node's bound under test.
    node = start_node(
        capacity="16MiB", extra_args=["--max-value-size", "2MiB", "--max-lease-bytes", "2MiB", "--max-lease-share", "1"]
    )
    client = make_client([node])
    keys = [b"b/%d" % i for i in range(3)]
    client.batch_put_views([(k, b"x" * MiB) for k in keys])
    assert client.lease(keys, ttl_s=60) == [True, True, False]
    assert metric_value(metrics_of(node), "memkv_node_leases_refused_total") == 1
    other = make_client([node])  # another holder: its token is its own, the bound is the node's
    assert other.lease(keys[:1], ttl_s=60) == [True]
    assert other.lease(keys[2:], ttl_s=60) == [False]


def test_restart_drops_leases_and_a_dead_or_stopped_node_answers_false_in_time(start_node, make_client):
    a, b = start_node.many(2)
    client = make_client([a, b], io_timeout_s=1.0)
    on_a, on_b = _keys_on(client, a, "r", 2), _keys_on(client, b, "r", 2)
    client.batch_put_views([(k, b"v") for k in on_a + on_b])
    assert client.lease(on_a + on_b, ttl_s=60) == [True] * 4
    b.signal(signal.SIGSTOP)
    try:
        t = time.monotonic()
        assert client.lease(on_a + on_b, ttl_s=60, timeout_s=0.5) == [True, True, False, False]
        assert time.monotonic() - t < 0.5 + 3.0
    finally:
        b.signal(signal.SIGCONT)
    fresh = restart_empty(a)
    try:
        client2 = make_client([fresh, b])
        assert metric_value(metrics_of(fresh), "memkv_node_leases") == 0
        client2.batch_put_views([(k, b"new") for k in on_a])  # nothing leased any more: stored
        assert [client2.get(k) for k in on_a] == [b"new", b"new"]
        assert client2.lease(on_a, ttl_s=60) == [True, True]
    finally:
        fresh.stop()


def test_one_holder_at_its_share_leaves_the_rest_of_the_bound_to_others_and_puts_still_store(start_node, make_client):
    # --max-lease-bytes 8 MiB, the default --max-lease-share 0.5: each holder (client) at most 4 MiB.
    node = start_node(capacity="32MiB", extra_args=["--max-value-size", "1MiB", "--max-lease-bytes", "8MiB"])
    greedy, other, writer = make_client([node]), make_client([node]), make_client([node])
    value = 256 << 10
    mine = [b"greedy/%d" % i for i in range(36)]  # 9 MiB: more than the node's whole bound
    theirs = [b"other/%d" % i for i in range(36)]
    assert greedy.batch_put_views([(k, b"g" * value) for k in mine]) == [True] * 36
    assert other.batch_put_views([(k, b"o" * value) for k in theirs]) == [True] * 36

    taken = greedy.lease(mine, ttl_s=60)
    held = sum(taken)
    leased = metric_value(metrics_of(node), "memkv_node_leased_bytes")
    assert 0 < held < 36 and leased <= 4 * MiB, f"one holder leased {held} values, {leased:.0f} bytes"
    assert greedy.lease(mine, ttl_s=60) == taken, "renewals at the share still answer True, nothing more"
    got = other.lease(theirs, ttl_s=60)
    assert sum(got) == held, "the other holder gets the same share: the greedy one did not take it"
    assert metric_value(metrics_of(node), "memkv_node_lease_holders") == 2

    # Leases at their bound (8 MiB of 32): a third client's stores still fit, evicting unleased values.
    stored = writer.batch_put_views([(b"w/%d" % i, b"w" * value) for i in range(120)])  # 30 MiB
    assert stored == [True] * 120
    leased_keys = [k for k, ok in zip(mine, taken) if ok] + [k for k, ok in zip(theirs, got) if ok]
    bufs = [(k, bytearray(value)) for k in leased_keys]
    assert writer.batch_get_into(bufs) == [True] * len(bufs), "every leased value survived the pressure"
