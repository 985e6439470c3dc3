"""Every read path counts a value whose checksum fails, in `memkv_client_integrity_failures`.

Behaviour under test, against real `memkv serve` processes: a value stored with a checksum that
does not match its bytes (a writer that got it wrong, or bytes that rotted on the node: the node
stores what it was sent) is, on each read path,

* a miss: `Client.get` answers None, `batch_get_into` False;
* counted once per read in `memkv_client_integrity_failures{server=...}` for the node's server;
* not a node failure: the node is not marked down and the next read of a good value works.

Paths: `Client.get` and `batch_get_into`, each over TCP and over the same-host socket, the
latter with shared memory on (a 1 MiB value, the size shared memory takes, stored by another
connection: it comes over the socket). The copy out of a value's memfd is covered in
tests/integration/test_shared_memory.py (a commit whose checksum is not of the bytes written),
RDMA loads in tests/rdma/test_rdma_loads.py.
"""

from __future__ import annotations

import os

import pytest

from memkv import protocol as p
from memkv.client import metrics as client_metrics
from memkv.client.node import NodeConnection
from memkv.config import ServerAddress

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
