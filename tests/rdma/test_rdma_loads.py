"""Loads by server-driven RDMA WRITE into a registered pool, against real nodes, over UCX tcp and cma.

Behaviour under test:
* with MEMKV_TRANSPORT=rdma and the pool registered, has_rdma() is true and loads of 4 KiB,
  1 MiB and 16 MiB values over 3 nodes land byte-exact in their slots; the nodes served them
  with RDMA_GET (their metrics say so), not GET;
* a MISS or a wrong length is a miss that was never written: the slot keeps its bytes and
  may_land_late is false;
* the client verifies each checksum over the landed bytes before counting a block loaded: a
  value stored with a wrong checksum is a miss (and counted as an integrity failure);
* a buffer outside the registered pool takes the TCP path;
* the RDMA control messages are guarded like every frame: RDMA_GET on a connection that did not
  RDMA_ATTACH is a protocol error; a descriptor outside the client's registered region is
  refused by NIXL (TRANSFER_FAILED), nothing is written and the node keeps serving;
* a node drops a client's metadata when the client's connections close;
* a node that reads an RDMA_GET after its client hung up (it was stalled) writes nothing.
"""

from __future__ import annotations

import os
import random
import signal
import socket

import pytest

from memkv import ServerError
from memkv import protocol as p
from memkv.client.node import NodeConnection
from memkv.config import ServerAddress
from memkv.nixl_adapter import buffer_address
from tests.faults.nodeops import all_threads_stopped, integrity_failures
from tests.rdma.conftest import node_requests, requires_nixl, wait_for

pytestmark = [pytest.mark.integration, requires_nixl]

KiB, MiB = 1 << 10, 1 << 20


def rdma_client(make_client, nodes, **kwargs):
    # Shared memory off: these nodes share the host, and a value this client stored would be
    # copied from the node's memory, hiding which path (RDMA or the socket) served it.
    kwargs.setdefault("shared_memory", False)
    return make_client(nodes, transport="rdma", io_timeout_s=kwargs.pop("io_timeout_s", 10.0), **kwargs)


def load_whole_into_pool(client, pool, keys, values):
    """Lay the values' slots out back to back in the pool, zero them, load over RDMA, and check
    every value landed whole with nothing that may land late."""
    slots, off = [], 0
    for v in values:
        slots.append(pool[off : off + len(v)])
        off += len(v)
    pool[:off] = bytes(off)
    result = client.batch_load_into(list(zip(keys, slots)))
    assert result.ok == [True] * len(values) and not result.may_land_late
    assert all(bytes(s) == v for s, v in zip(slots, values))


def test_loads_land_byte_exact_in_pool_slots(ucx, start_node, make_client, pool):
    nodes = start_node.many(3)
    client = rdma_client(make_client, nodes)
    assert not client.has_rdma()  # nothing registered yet
    assert client.register_pool(pool) is True and client.has_rdma()
    sizes = [4 * KiB, 1 * MiB, 16 * MiB, 16 * MiB, 4 * KiB, 1 * MiB]
    rng = random.Random(7)
    values = [rng.randbytes(n) for n in sizes]
    keys = [f"rdma/{ucx}/{i}" for i in range(len(sizes))]
    assert client.batch_put_views(list(zip(keys, values))) == [True] * len(sizes)
    load_whole_into_pool(client, pool, keys, values)
    owners = {client.owner(k).name for k in keys}
    assert {n.address for n in nodes if node_requests(n, "rdma_get") >= 1} == owners  # one RDMA_GET per owner
    assert sum(node_requests(n, "get") for n in nodes) == 0


def test_miss_and_wrong_length_are_never_written(ucx, start_node, make_client, pool):
    (node,) = start_node.many(1)
    client = rdma_client(make_client, [node])
    client.register_pool(pool)
    assert client.batch_put_views([("rdma/short", b"x" * 1000)]) == [True]
    pool[: 2 * MiB] = b"\xab" * (2 * MiB)
    result = client.batch_load_into([("rdma/absent", pool[:MiB]), ("rdma/short", pool[MiB : 2 * MiB])])
    assert result.ok == [False, False] and not result.may_land_late
    assert bytes(pool[: 2 * MiB]) == b"\xab" * (2 * MiB)


def test_checksum_is_verified_before_a_block_counts_as_loaded(ucx, start_node, make_client, pool, auth_key_hex):
    (node,) = start_node.many(1)
    client = rdma_client(make_client, [node])
    client.register_pool(pool)
    value = os.urandom(MiB)
    wrong = client.checksummer.compute(b"something else")
    conn = NodeConnection(ServerAddress(node.host, node.port), bytes.fromhex(auth_key_hex), 2.0, 5.0)
    try:  # a writer that got the checksum wrong (or bytes that rotted on the node)
        reply = conn.request(
            p.PutRequest((p.PutItem(b"rdma/corrupt", MiB, client.checksummer.algo, wrong),)), [memoryview(value)]
        )
        assert reply.statuses == bytes([p.ItemStatus.OK])
    finally:
        conn.close()
    before = integrity_failures()
    result = client.batch_load_into([("rdma/corrupt", pool[:MiB])])
    assert result.ok == [False]
    assert integrity_failures() == before + 1, "counted in memkv_client_integrity_failures"
    assert bytes(pool[:MiB]) == value  # it did land; it just did not verify
    assert result.may_land_late  # a failed RDMA block is withheld, whatever the reason


def test_buffers_outside_the_pool_take_the_tcp_path(ucx, start_node, make_client, pool):
    (node,) = start_node.many(1)
    client = rdma_client(make_client, [node])
    client.register_pool(pool)
    value = os.urandom(MiB)
    client.put("rdma/outside", value)
    scratch = bytearray(MiB)
    assert client.batch_get_into([("rdma/outside", scratch)]) == [True] and bytes(scratch) == value
    assert node_requests(node, "get") == 1 and node_requests(node, "rdma_get") == 0


def test_rdma_get_needs_rdma_attach_on_that_connection(ucx, start_node, auth_key_hex):
    (node,) = start_node.many(1)
    conn = NodeConnection(ServerAddress(node.host, node.port), bytes.fromhex(auth_key_hex), 2.0, 5.0)
    try:
        with pytest.raises(ServerError) as info:
            conn.request(p.RdmaGetRequest((b"k",), (4096,), (0x10000,), 1000, 1))
        assert info.value.code == p.ErrorCode.MALFORMED
    finally:
        conn.close()


def test_descriptor_outside_the_registered_region_writes_nothing(ucx, start_node, make_client, pool, auth_key_hex):
    (node,) = start_node.many(1)
    client = rdma_client(make_client, [node])
    client.register_pool(pool)
    client.put("rdma/target", os.urandom(MiB))
    metadata = client._transport._metadata
    end = buffer_address(pool) + len(pool)
    conn = NodeConnection(ServerAddress(node.host, node.port), bytes.fromhex(auth_key_hex), 2.0, 5.0)
    try:
        reply = conn.request(p.RdmaAttachRequest(p.RdmaBackend.NIXL_UCX, metadata))
        assert reply.status == p.RdmaAttachStatus.OK
        for address in (end - MiB // 2, end, 4096):  # straddling the end, past it, unregistered
            reply = conn.request(p.RdmaGetRequest((b"rdma/target",), (MiB,), (address,), 2000, 99))
            assert [it.status for it in reply.items] == [p.ItemStatus.TRANSFER_FAILED]
        assert isinstance(conn.request(p.PingRequest()), p.PingReply)  # the connection stays usable
    finally:
        conn.close()
    assert client.batch_load_into([("rdma/target", pool[:MiB])]).ok == [True]


def test_a_node_writes_nothing_for_a_request_whose_client_hung_up_before_it_was_read(
    ucx, start_node, make_client, pool, auth_key_hex
):
    """A node that was stalled (SIGSTOP) reads an RDMA_GET late, after its client gave up and
    closed the connection: it must not WRITE into that client's memory (the client may be
    dropping its NIXL agent: docs/rdma.md, "Known crash"). The same request on a live
    connection lands, so the slot staying zero is the node's choice, not a bad request."""
    (node,) = start_node.many(1)
    client = rdma_client(make_client, [node])
    client.register_pool(pool)
    value = os.urandom(MiB)
    client.put("rdma/late", value)
    metadata = client._transport._metadata
    slot = pool[:MiB]
    address = buffer_address(pool)

    def connect() -> NodeConnection:
        conn = NodeConnection(ServerAddress(node.host, node.port), bytes.fromhex(auth_key_hex), 2.0, 5.0)
        assert conn.request(p.RdmaAttachRequest(p.RdmaBackend.NIXL_UCX, metadata)).status == p.RdmaAttachStatus.OK
        return conn

    slot[:] = bytes(MiB)
    conn = connect()
    try:
        node.signal(signal.SIGSTOP)
        assert wait_for(lambda: all_threads_stopped(node.pid), 5.0)
        conn.send(p.RdmaGetRequest((b"rdma/late",), (MiB,), (address,), 2000, 7))
        conn.sock.shutdown(socket.SHUT_WR)  # the client gives up: its FIN follows the request
        node.signal(signal.SIGCONT)
        reply = conn.read_reply()  # the node still answers a half-closed connection
        assert [it.status for it in reply.items] == [p.ItemStatus.TRANSFER_FAILED]
    finally:
        node.signal(signal.SIGCONT)
        conn.close()
    assert bytes(slot) == bytes(MiB), "the node wrote into the memory of a client that had hung up"
    conn = connect()
    try:
        reply = conn.request(p.RdmaGetRequest((b"rdma/late",), (MiB,), (address,), 2000, 8))
        assert [it.status for it in reply.items] == [p.ItemStatus.OK]
    finally:
        conn.close()
    assert bytes(slot) == value


def test_attach_with_bad_metadata_is_rejected_not_fatal(ucx, start_node, auth_key_hex):
    (node,) = start_node.many(1)
    conn = NodeConnection(ServerAddress(node.host, node.port), bytes.fromhex(auth_key_hex), 2.0, 5.0)
    try:
        reply = conn.request(p.RdmaAttachRequest(p.RdmaBackend.NIXL_UCX, os.urandom(300)))
        assert reply.status == p.RdmaAttachStatus.REJECTED and "NIXL" in reply.info
        reply = conn.request(p.RdmaAttachRequest(77, b"x"))
        assert reply.status == p.RdmaAttachStatus.REJECTED
        assert isinstance(conn.request(p.PingRequest()), p.PingReply)
    finally:
        conn.close()


def test_node_forgets_a_client_when_its_connections_close(ucx, start_node, make_client, pool):
    node = start_node(env={"MEMKV_LOG_LEVEL": "info"})
    client = rdma_client(make_client, [node])
    client.register_pool(pool)
    client.put("rdma/k", b"v" * 4096)
    assert client.batch_load_into([("rdma/k", pool[:4096])]).ok == [True]
    name = client._transport._agent.name
    assert wait_for(lambda: any(f"{name} attached" in line for line in node.output), 5.0)
    client.close()
    assert wait_for(lambda: any(f"{name} detached" in line for line in node.output), 10.0), "".join(node.output)[-2000:]


def _registrations(node) -> dict[str, float]:
    from tests.faults.nodeops import metric_value, metrics_of

    text = metrics_of(node)
    return {w: metric_value(text, "memkv_node_rdma_registrations_total", when=w) for w in ("alloc", "read")}


@pytest.mark.parametrize("node_transport", ["rdma", "auto"])
def test_a_node_registers_its_buffers_off_the_read_path(ucx, start_node, make_client, pool, node_transport):
    """A value is mostly read once, so a registration on the read path is paid by nearly every
    read: a node started with MEMKV_TRANSPORT=rdma brings NIXL up at start and registers each
    buffer of 1 MiB or more as its PUT makes it; an `auto` node (NIXL loads on the first attach)
    registers on first read what it stored before, and at allocation from then on. Either way
    every value lands whole, and a buffer is registered once however often it is read."""
    (node,) = start_node.many(1, env={"MEMKV_TRANSPORT": node_transport})
    client = rdma_client(make_client, [node])
    rng = random.Random(11)
    sizes = [MiB, 4 * MiB, 16 * MiB, 4 * KiB]  # the 4 KiB value: below the threshold, registered on read
    values = [rng.randbytes(n) for n in sizes]
    keys = [f"reg/{node_transport}/{i}" for i in range(len(sizes))]
    # Stored before the client attaches (an engine restarted onto a filled cluster).
    assert client.batch_put_views(list(zip(keys, values))) == [True] * len(sizes)
    assert client.register_pool(pool)
    before = _registrations(node)
    big = len(sizes) - 1
    assert before == ({"alloc": big, "read": 0} if node_transport == "rdma" else {"alloc": 0, "read": 0})
    load_whole_into_pool(client, pool, keys, values)
    first = _registrations(node)
    assert first == {"alloc": before["alloc"], "read": 1 if node_transport == "rdma" else len(sizes)}
    load_whole_into_pool(client, pool, keys, values)  # a second read registers nothing
    assert _registrations(node) == first
    # After NIXL is up, new buffers are registered by the PUT that makes them, on both nodes.
    more = [(f"reg/{node_transport}/new", rng.randbytes(2 * MiB))]
    assert client.batch_put_views(more) == [True]
    assert _registrations(node) == {"alloc": first["alloc"] + 1, "read": first["read"]}
    assert node_requests(node, "get") == 0
