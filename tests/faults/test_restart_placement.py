"""Restarts and server-list changes lose only cache: placement stays consistent, bytes stay right.

Behaviour under test, on real nodes with the real client (every value carries its key, the node
it was placed on and a version, so a read can tell where its bytes came from):

* a node restarted empty on the same port: its keys become misses (its cache is gone), every
  other key still reads back byte-exact from its owner, stores land on the owner again, and no
  node ever holds a key it does not own;
* clients whose server lists differ (a node added, a node removed): a key moves only when
  rendezvous hashing gives it another owner (added node: only to that node; removed node: only
  its own keys move), moved keys read as misses until stored again, every hit is a value written
  for that key on that same node (never one answered from another node's placement), and after
  each client stores its keys every node holds only keys that some configured list assigns to it.
"""

from __future__ import annotations

import hashlib

import pytest

from tests.faults.nodeops import restart_empty

pytestmark = pytest.mark.faults
OVER_TLS_TOO = True  # tests/faults/conftest.py: each test also runs against TLS-only nodes

VALUE_BYTES = 8192


def value_for(key: str, node: str, version: int) -> bytes:
    head = f"{key}|{node}|{version}|".encode()
    return head + hashlib.shake_256(head).digest(VALUE_BYTES - len(head))


def parse(value: bytes) -> tuple[str, str, int]:
    key, node, version, _ = value.split(b"|", 3)
    return key.decode(), node.decode(), int(version)


def check_read(client, keys, version_ok) -> tuple[dict, list[str]]:
    """Read every key; return ({key: (node, version)} for hits, problems)."""
    hits, problems = {}, []
    for key in keys:
        value = client.get(key)
        if value is None:
            continue
        k, node, version = parse(value)
        owner = client.owner(key).name
        if k != key:
            problems.append(f"{key}: got the value of {k}")
        elif node != owner:
            problems.append(f"{key}: read from {owner} a value placed on {node}")
        elif value != value_for(k, node, version) or not version_ok(key, version):
            problems.append(f"{key}: bytes of a value never written (version {version})")
        hits[key] = (node, version)
    return hits, problems


def holdings(client, nodes, keys) -> dict[str, set[str]]:
    """Which keys each node holds (asked directly, ignoring placement)."""
    return {n.address: {k for k, there in zip(keys, client.exists_on(n.address, keys)) if there} for n in nodes}


def test_node_restarted_empty_loses_only_its_cache(start_node, make_client, wait_until, figures):
    nodes = start_node.many(3, capacity="64MiB")
    client = make_client(nodes, down_for_s=0.2)
    keys = [f"restart/{i}" for i in range(300)]
    for key in keys:
        client.put(key, value_for(key, client.owner(key).name, 1))
    victim = nodes[1]
    owned = {k for k in keys if client.owner(k).name == victim.address}
    assert 50 < len(owned) < 150

    fresh = restart_empty(victim, capacity="64MiB")
    start_node.nodes.append(fresh)
    client.exists(keys)  # the pooled sockets to the old process fail once: the node is marked down
    wait_until(lambda: all(h["up"] for h in client.health()), 5.0, what="the down mark to expire")
    hits, problems = check_read(client, keys, lambda k, v: v == 1)
    assert not problems, problems[:5]
    assert set(hits) == set(keys) - owned, "exactly the restarted node's keys are lost, nothing else"

    for key in keys:  # stored again: they land on their owner, the restarted node included
        client.put(key, value_for(key, client.owner(key).name, 2))
    held = holdings(client, nodes, keys)
    for node in nodes:
        assert held[node.address] == {k for k in keys if client.owner(k).name == node.address}, node.address
    hits, problems = check_read(client, keys, lambda k, v: v == 2)
    assert not problems and len(hits) == len(keys)
    figures(restart_keys=len(keys), restart_lost_keys=len(owned), restart_kept_keys=len(keys) - len(owned))


def test_clients_with_different_server_lists_keep_placement_consistent(start_node, make_client, figures):
    nodes = start_node.many(4, capacity="64MiB")
    n0, n1, n2, n3 = nodes
    three = make_client([n0, n1, n2])
    four = make_client([n0, n1, n2, n3])  # a node added
    two = make_client([n0, n2])  # a node removed
    keys = [f"place/{i}" for i in range(400)]
    for key in keys:
        three.put(key, value_for(key, three.owner(key).name, 1))

    # Added node: a key moves only to it, and reads of moved keys miss.
    moved_to_n3 = {k for k in keys if four.owner(k).name != three.owner(k).name}
    assert all(four.owner(k).name == n3.address for k in moved_to_n3), "HRW moved a key between old nodes"
    assert 60 < len(moved_to_n3) < 140  # about a quarter
    hits, problems = check_read(four, keys, lambda k, v: v == 1)
    assert not problems, problems[:5]
    assert set(hits) == set(keys) - moved_to_n3

    # Removed node: only its keys move, to the remaining nodes.
    moved_off_n1 = {k for k in keys if two.owner(k).name != three.owner(k).name}
    assert moved_off_n1 == {k for k in keys if three.owner(k).name == n1.address}
    hits, problems = check_read(two, keys, lambda k, v: v == 1)
    assert not problems, problems[:5]
    assert set(hits) == set(keys) - moved_off_n1

    # Each client stores its own version; every read still comes from the reader's own owner and
    # returns a value written for that key on that node (the reader's view may be older).
    for version, client in ((2, four), (3, two)):
        for key in keys:
            client.put(key, value_for(key, client.owner(key).name, version))
    for client in (three, four, two):
        hits, problems = check_read(client, keys, lambda k, v: v in (1, 2, 3))
        assert not problems, problems[:5]
        assert len(hits) == len(keys)
    held = holdings(four, nodes, keys)  # the client that knows every node
    lists = (three, four, two)
    for node in nodes:
        allowed = {k for k in keys if any(c.owner(k).name == node.address for c in lists)}
        assert held[node.address] <= allowed, f"{node.address} holds keys no list places there"
    figures(
        placement_keys=len(keys),
        moved_when_node_added=len(moved_to_n3),
        moved_when_node_removed=len(moved_off_n1),
        wrong_node_answers=0,
    )
