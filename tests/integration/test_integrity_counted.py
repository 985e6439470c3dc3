"""Every read path counts a value whose checksum fails, in `memkv_client_integrity_failures`.

Behaviour under test, against real `memkv serve` processes: a value stored with a checksum that
does not match its bytes (a writer that got it wrong, or bytes that rotted on the node: the node
stores what it was sent) is, on each read path,

* a miss: `Client.get` answers None, `batch_get_into` False;
* counted once per read in `memkv_client_integrity_failures{server=...}` for the node's server;
* not a node failure: the node is not marked down and the next read of a good value works.

Paths: `Client.get` and `batch_get_into`, each over TCP and over the same-host socket, the
latter with shared memory on (a 1 MiB value, the size shared memory takes, stored by another
connection: it comes over the socket); and a copy out of shared memory of a value this client
stored there, one of whose bytes then rotted in the node's memory (flipped through
/proc/<pid>/mem). RDMA loads are covered in tests/rdma/test_rdma_loads.py.
"""

from __future__ import annotations

import os

import pytest

from memkv import protocol as p
from memkv.client import metrics as client_metrics
from memkv.client.node import NodeConnection
from memkv.config import ServerAddress
from tests.faults.nodeops import metric_value, metrics_of

pytestmark = pytest.mark.integration

MiB = 1 << 20


def integrity_failures(server: str) -> float:
    return sum(
        s.value
        for m in client_metrics.INTEGRITY_FAILURES.collect()
        for s in m.samples
        if s.name.endswith("_total") and s.labels.get("server") == server
    )


def store_with_wrong_checksum(node, auth_key_hex: str, key: bytes, value: bytes, checksummer) -> None:
    conn = NodeConnection(ServerAddress(node.host, node.port), bytes.fromhex(auth_key_hex), 2.0, 5.0)
    try:
        wrong = checksummer.compute(b"not these bytes")
        reply = conn.request(p.PutRequest((p.PutItem(key, len(value), checksummer.algo, wrong),)), [memoryview(value)])
        assert reply.statuses == bytes([p.ItemStatus.OK])
    finally:
        conn.close()


def _read_get(client, key: bytes, size: int) -> bool:
    return client.get(key) is not None


def _read_batch(client, key: bytes, size: int) -> bool:
    return client.batch_get_into([(key, bytearray(size))]) == [True]


@pytest.mark.parametrize("read", [_read_get, _read_batch], ids=["get", "batch_get_into"])
@pytest.mark.parametrize("path", ["tcp", "local-socket", "shared-memory"])
def test_a_checksum_failure_is_a_miss_and_counted_on_every_read_path(start_node, make_client, auth_key_hex, read, path):
    node = start_node(capacity="64MiB")
    kwargs = {"tcp": {"local_socket": False}, "local-socket": {"shared_memory": False}, "shared-memory": {}}[path]
    client = make_client([node], **kwargs)
    server = f"{node.host}:{node.port}"
    size = MiB if path == "shared-memory" else 4096
    good = os.urandom(size)
    assert client.batch_put_views([("good", good)]) == [True]
    store_with_wrong_checksum(node, auth_key_hex, b"rotten", os.urandom(size), client.checksummer)
    assert client.local_servers() == ([] if path == "tcp" else [server])

    before = integrity_failures(server)
    for _ in range(3):
        assert read(client, b"rotten", size) is False, "a value that fails its checksum is a miss"
    assert integrity_failures(server) == before + 3, "each failed verification is counted"
    assert read(client, b"good", size) is True
    assert [h["up"] for h in client.health()] == [True], "a checksum failure is not a node failure"
    assert integrity_failures(server) == before + 3


def _flip_byte_in_arena(pid: int, arena: int, offset: int) -> None:
    """Flip one byte of the node's arena `arena` at `offset`, in the node's own mapping: bytes
    that rotted in the node's memory after they were committed."""
    name = f"/memfd:memkv-arena-{arena} "
    with open(f"/proc/{pid}/maps") as maps:
        starts = [int(line.split("-", 1)[0], 16) for line in maps if name in line + " "]
    assert len(starts) == 1, f"the node maps arena {arena} once"
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(starts[0] + offset)
        byte = mem.read(1)
        mem.seek(starts[0] + offset)
        mem.write(bytes([byte[0] ^ 0xFF]))


def test_a_value_that_rotted_in_shared_memory_is_a_miss_and_counted(start_node, make_client):
    node = start_node(capacity="64MiB")
    client = make_client([node])
    server = f"{node.host}:{node.port}"
    value = os.urandom(MiB)
    assert client.batch_put_views([("shm/rotten", value)]) == [True]
    assert client.shared_memory_servers() == [server]
    memory = client._nodes[0]._memory
    assert memory is not None and b"shm/rotten" in memory._warm_keys, "stored through shared memory, warm here"
    arena, offset = memory._warm_keys[b"shm/rotten"]
    buf = bytearray(MiB)
    assert client.batch_get_into([("shm/rotten", buf)]) == [True] and buf == value

    _flip_byte_in_arena(node.pid, arena, offset + 1000)
    before = integrity_failures(server)
    requests = {op: metric_value(metrics_of(node), "memkv_node_requests_total", op=op) for op in ("get", "shm_get")}
    assert client.batch_get_into([("shm/rotten", buf)]) == [False], "a copy that fails its checksum is a miss"
    assert integrity_failures(server) == before + 1
    after = {op: metric_value(metrics_of(node), "memkv_node_requests_total", op=op) for op in ("get", "shm_get")}
    assert after == {"get": requests["get"], "shm_get": requests["shm_get"] + 1}, "copied from shared memory"
    assert [h["up"] for h in client.health()] == [True]
