"""LIST end to end: real `memkv serve` processes on 127.0.0.1, the real client and codec.

Behaviour under test:
* keys put through the client over 3 nodes come back from `Client.list_keys` merged in byte
  order, each with its value's length and its HRW owner, filtered by prefix;
* `limit` cuts the merged listing at the cluster's first `limit` keys and sets `truncated`;
  exactly `limit` matching keys is not truncated;
* a killed node does not make the listing fail silently: `failed` names it (and why) while the
  other nodes' keys are still listed; restarted on its port (empty) it answers the next listing;
* a client with a wrong auth key lists nothing: every node refuses it and is named in `failed`;
* a hand-built LIST with a limit over `max_list_keys`, a limit of 0 or a prefix over 480 bytes
  gets an ERROR frame with its code, then a close, and the node keeps serving;
* the node counts LIST in `memkv_node_requests_total{op="list"}` and the keys it listed.

All traffic is on 127.0.0.1; every wait is a socket timeout, a process wait or a
deadline-bounded poll.
"""

from __future__ import annotations

import re
import struct

import pytest

from memkv import KeyListing
from memkv import protocol as p
from memkv.local import LocalNode, new_key_hex
from tests.faults.nodeops import metric_value, metrics_of
from tests.security.raw import RawSession

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(start_module_node):
    return start_module_node.many(3, capacity="64MiB")


def put_all(client, keys: list[bytes]) -> None:
    ok = client.batch_put_views([(k, memoryview(b"v" * (1 + i % 7))) for i, k in enumerate(keys)])
    assert all(ok), "setup: every value must be stored"


def summary(listing: KeyListing) -> list[tuple[bytes, int, str]]:
    return [(e.key, e.length, e.server) for e in listing.keys]


def test_keys_put_over_three_nodes_come_back_merged_in_byte_order_with_lengths_and_owners(cluster, make_client) -> None:
    client = make_client(cluster)
    keys = [b"merge/%03d" % i for i in range(60)] + [b"merge/\x00bin", b"merge/\xffbin", b"mergeX"]
    put_all(client, keys)
    listing = client.list_keys(b"merge/")
    expected = sorted((k, 1 + keys.index(k) % 7, client.owner(k).name) for k in keys if k.startswith(b"merge/"))
    assert summary(listing) == expected
    assert listing.truncated is False and listing.failed == {} and listing.complete
    # HRW spread them: every node contributed, and each key came from its owner only.
    assert {e.server for e in listing.keys} == {n.address for n in cluster}
    assert [e.key for e in client.list_keys(b"merge/\xff").keys] == [b"merge/\xffbin"]
    assert client.list_keys(b"merge/none").keys == ()


def test_limit_cuts_at_the_clusters_first_keys_and_says_it_was_truncated(cluster, make_client) -> None:
    client = make_client(cluster)
    keys = [b"limit/%02d" % i for i in range(30)]
    put_all(client, keys)
    cut = client.list_keys(b"limit/", limit=7)
    assert [e.key for e in cut.keys] == keys[:7] and cut.truncated is True
    exact = client.list_keys(b"limit/", limit=30)
    assert [e.key for e in exact.keys] == keys and exact.truncated is False
    one = client.list_keys(b"limit/", limit=1)
    assert [e.key for e in one.keys] == [b"limit/00"] and one.truncated is True


def test_usage_errors_are_raised_before_any_io(cluster, make_client) -> None:
    client = make_client(cluster)
    for bad in (0, -1, 4097):
        with pytest.raises(ValueError, match=r"limit must be 1\.\.4096"):
            client.list_keys(b"", limit=bad)
    with pytest.raises(ValueError, match=r"prefix must be 0\.\.480 bytes, got 481"):
        client.list_keys(b"k" * 481)


def test_a_killed_node_is_named_in_failed_and_the_others_keys_are_still_listed(
    start_node, make_client, auth_key_hex
) -> None:
    nodes = start_node.many(3, capacity="64MiB")
    client = make_client(nodes, io_timeout_s=2.0, connect_timeout_s=1.0)
    keys = [b"kill/%02d" % i for i in range(30)]
    put_all(client, keys)
    victim = nodes[1]
    victim.kill()
    listing = client.list_keys(b"kill/")
    assert list(listing.failed) == [victim.address]
    # How the dead node shows depends on the socket: a reset TCP connection, a broken pipe on the
    # same-host socket, or a refused connect; each names the node and the failed operation.
    why = listing.failed[victim.address]
    assert victim.address in why and re.search(r"(connect|read|write) failed", why), why
    assert not listing.complete
    survivors = sorted(k for k in keys if client.owner(k).name != victim.address)
    assert [e.key for e in listing.keys] == survivors
    # The node comes back on its port, empty (values live in memory only): it answers the next
    # listing at once, without waiting out its down mark (list_keys ignores it).
    with LocalNode(auth_key_hex, capacity="64MiB", port=victim.port, ready_timeout_s=30.0):
        again = client.list_keys(b"kill/")
    assert again.failed == {} and [e.key for e in again.keys] == survivors


def test_a_client_with_the_wrong_auth_key_lists_nothing_and_names_every_node(cluster, make_client) -> None:
    client = make_client(cluster, auth_key_hex=new_key_hex())
    listing = client.list_keys(b"")
    assert listing.keys == ()
    assert sorted(listing.failed) == sorted(n.address for n in cluster)
    assert all("MEMKV_AUTH_KEY" in why for why in listing.failed.values())


@pytest.mark.parametrize(
    "meta,code",
    [
        (struct.pack(">IH", 4097, 0), p.ErrorCode.BATCH_TOO_LARGE),
        (struct.pack(">IH", 0, 0), p.ErrorCode.MALFORMED),
        (struct.pack(">IH", 10, 481) + b"k" * 481, p.ErrorCode.KEY_TOO_LONG),
        (struct.pack(">IH", 10, 5) + b"k", p.ErrorCode.MALFORMED),
    ],
    ids=["limit-4097", "limit-0", "prefix-481-bytes", "prefix-truncated"],
)
def test_a_bad_list_request_gets_an_error_frame_then_close_and_the_node_keeps_serving(
    cluster, auth_key_hex, make_client, meta, code
) -> None:
    node = cluster[0]
    with RawSession(node, auth_key_hex) as raw:
        raw.handshake()
        raw.send(raw.frame(p.Opcode.LIST, meta))
        error = raw.error_then_close()
    assert error.code == code
    client = make_client([node])
    client.put(b"after-bad-list", b"x")
    assert [e.key for e in client.list_keys(b"after-bad-list").keys] == [b"after-bad-list"]


def test_the_node_counts_list_requests_and_listed_keys(cluster, make_client, wait_until) -> None:
    node = cluster[2]
    client = make_client([node])
    before = metrics_of(node)
    put_all(client, [b"count/a", b"count/b", b"count/c"])
    assert len(client.list_keys(b"count/").keys) == 3
    assert len(client.list_keys(b"count/", limit=2).keys) == 2

    def counted() -> bool:
        text = metrics_of(node)
        requests = metric_value(text, "memkv_node_requests_total", op="list") - metric_value(
            before, "memkv_node_requests_total", op="list"
        )
        listed = metric_value(text, "memkv_node_keys_total", op="list", result="ok") - metric_value(
            before, "memkv_node_keys_total", op="list", result="ok"
        )
        return requests == 2 and listed == 5

    wait_until(counted, 5.0, what="LIST counted in the node's metrics")
    assert 'memkv_node_request_seconds_count{op="list"}' in metrics_of(node)
