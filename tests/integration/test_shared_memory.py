"""Shared memory for same-host clients (docs/protocol.md section 13, memkv/client/shared.py).

Behaviour under test, against real `memkv serve` processes on 127.0.0.1:
* with `shared_memory` on, a client's loads from a same-host node copy values of 1 MiB and more
  from the node's memory (SHM_GET, SHM_ATTACH counted by the node) byte-exact, with the compiled
  copy loop and with the pure-Python one, xxh3 and blake3 alike; smaller values in the same
  batch come over the socket (NOT_SHARED);
* a client copies from there only the values it stored itself (it fills its page tables for
  them right after the PUT: SHM_PLACE, counted by the node as no read); another client's values,
  and its own once replaced by another client, come over the socket; every byte is counted as
  sent once;
* it is on by default on the client; `shared_memory` off there, or `memkv serve
  --no-shared-memory`, sends no SHM request: values then all come over the socket;
* a value the client was told about stays whole while pinned, even when its key is replaced;
  once the pins ended and the buffer holds another value, a copy from the old place fails its
  checksum: a miss, never wrong bytes;
* a client that stays silent after an SHM_GET holds its pins no longer than SHM_PIN_S: a full
  node then evicts those values for new ones;
* a node restarted on the same port (same node_id) is mapped anew, and the mapping of the dead
  process is released;
* SHM requests off the same-host socket are refused with an error naming it; an arena id that
  is none is answered without a descriptor, and the client says so.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest

from memkv import protocol as p
from memkv.client import shared
from memkv.client.node import NodeConnection, local_connect
from memkv.client.shared import NodeMemory, copy_verified
from memkv.config import AuthKey, ServerAddress
from memkv.errors import LocalProtocolError, MemKVError, RemoteProtocolError, ServerError
from memkv.integrity import Checksummer
from tests.faults.nodeops import restart_empty

pytestmark = pytest.mark.integration

MiB = 1 << 20


def status_of(node) -> dict:
    with urllib.request.urlopen(node.admin_url + "/v1/status", timeout=5) as resp:
        return json.loads(resp.read())


def metric(node, series: str) -> float:
    with urllib.request.urlopen(node.admin_url + "/v1/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = [x for x in text.splitlines() if x.startswith(series + " ")]
    return float(found[0].split()[1]) if found else 0.0


def requests_of(node, op: str) -> float:
    return metric(node, f'memkv_node_requests_total{{op="{op}"}}')


def raw_connection(node, auth_key_hex: str, local: bool = True) -> NodeConnection:
    key = AuthKey.from_hex(auth_key_hex, "test").raw
    address = ServerAddress(node.host, node.port)
    if not local:
        return NodeConnection(address, key, 2.0, 5.0)
    return NodeConnection(address, key, 2.0, 5.0, connect=local_connect(status_of(node)["local_socket"]))


@pytest.mark.parametrize(("copy_loop", "integrity"), [("compiled", "xxh3"), ("python", "xxh3"), ("python", "blake3")])
def test_values_are_copied_from_the_nodes_memory_byte_exact(start_node, make_client, monkeypatch, copy_loop, integrity):
    if copy_loop == "python":
        monkeypatch.setattr(shared, "COMPILED_COPY", False)
    elif not shared.COMPILED_COPY:
        pytest.skip("the compiled copy loop is not built here")
    node = start_node(capacity="256MiB")
    client = make_client([node], shared_memory=True, integrity=integrity)
    values = {f"k{i}": os.urandom(size) for i, size in enumerate([1, 4096, 1 * MiB, 3 * MiB + 5, 16 * MiB])}
    assert client.batch_put_views(list(values.items())) == [True] * len(values)
    gets_before = requests_of(node, "get")
    targets = [(key, bytearray(len(value))) for key, value in values.items()]
    assert client.batch_get_into(targets) == [True] * len(values)
    assert all(buf == values[key] for key, buf in targets)
    assert requests_of(node, "shm_get") >= 1 and requests_of(node, "shm_attach") >= 1
    assert requests_of(node, "get") > gets_before, "the small values came over the socket (NOT_SHARED)"
    assert status_of(node)["shared_memory"]["arenas"] >= 1
    assert [n.shared for n in client._nodes] == [True]


def test_a_client_copies_what_it_stored_and_receives_the_rest(start_node, make_client):
    node = start_node(capacity="256MiB")
    own, other = (make_client([node], shared_memory=True) for _ in range(2))  # two mappings
    mine, theirs = os.urandom(4 * MiB), os.urandom(4 * MiB)
    sent = metric(node, "memkv_node_sent_bytes_total")
    assert own.batch_put_views([("mine", mine)]) == [True]
    assert other.batch_put_views([("theirs", theirs)]) == [True]
    assert requests_of(node, "shm_put") == 2, "each writer wrote its value into the node's memory itself"
    assert metric(node, "memkv_node_sent_bytes_total") == sent, "a store reads nothing"

    def load(client, keys):
        before = {op: requests_of(node, op) for op in ("get", "shm_get")}
        targets = [bytearray(4 * MiB) for _ in keys]
        assert client.batch_get_into(list(zip(keys, targets))) == [True] * len(keys)
        return [bytes(t) for t in targets], {op: requests_of(node, op) - n for op, n in before.items()}

    got, ops = load(own, ["mine", "theirs"])
    assert got == [mine, theirs]
    assert ops == {"shm_get": 1, "get": 1}, "its own value copied, the other one received"
    got, ops = load(other, ["mine", "theirs"])
    assert got == [mine, theirs] and ops == {"shm_get": 1, "get": 1}
    assert metric(node, "memkv_node_sent_bytes_total") == sent + 16 * MiB, "each byte counted once"

    replaced = os.urandom(4 * MiB)
    assert other.batch_put_views([("mine", replaced)]) == [True]  # another slot, which `own` never filled
    got, ops = load(own, ["mine"])
    assert got == [replaced] and ops == {"shm_get": 1, "get": 1}, "placed, found cold, received"
    got, ops = load(other, ["mine"])
    assert got == [replaced] and ops == {"shm_get": 1, "get": 0}


def test_on_by_default_off_with_the_client_switch_or_on_a_private_node(start_node, make_client):
    node = start_node(capacity="128MiB")
    value = os.urandom(2 * MiB)
    plain = make_client([node])  # the default
    assert plain.batch_put_views([("v", value)]) == [True]
    buf = bytearray(len(value))
    assert plain.batch_get_into([("v", buf)]) == [True] and buf == value
    assert requests_of(node, "shm_put") == 1 and requests_of(node, "shm_get") == 1
    assert plain.shared_memory_servers() == plain.local_servers() == [a.name for a in plain.servers()]

    switched_off = make_client([node], shared_memory=False)
    assert switched_off.batch_put_views([("w", value)]) == [True]
    buf = bytearray(len(value))
    assert switched_off.batch_get_into([("w", buf)]) == [True] and buf == value
    assert requests_of(node, "shm_put") == 1 and requests_of(node, "shm_get") == 1, "no SHM request of its own"
    assert switched_off.shared_memory_servers() == [] and switched_off.local_servers()

    private = start_node(capacity="128MiB", extra_args=["--no-shared-memory"])
    assert status_of(private)["shared_memory"] is None
    client = make_client([private])
    assert client.batch_put_views([("v", value)]) == [True]
    buf = bytearray(len(value))
    assert client.batch_get_into([("v", buf)]) == [True] and buf == value
    assert requests_of(private, "shm_get") == 0 and requests_of(private, "shm_put") == 0
    assert client.shared_memory_servers() == [] and client.local_servers(), "the same-host socket stays on"


def _place(conn: NodeConnection, key: bytes, length: int) -> tuple[p.GetReplyItem, int, int]:
    reply = conn.request(p.ShmGetRequest((key,), (length,)))
    assert isinstance(reply, p.ShmGetReply)
    (item,), (arena,), (offset,) = reply.items, reply.arenas, reply.offsets
    assert item.status == p.ItemStatus.OK
    return item, arena, offset


def test_a_pinned_value_stays_whole_and_a_reused_buffer_is_a_miss(start_node, make_client, auth_key_hex):
    node = start_node(capacity="256MiB")
    writer = make_client([node])
    v1, v2, v3 = (os.urandom(4 * MiB) for _ in range(3))
    assert writer.batch_put_views([("k", v1)]) == [True]
    conn = raw_connection(node, auth_key_hex)
    memory = NodeMemory(status_of(node)["local_socket"])
    checksummer = Checksummer(AuthKey.from_hex(auth_key_hex, "test").raw)
    try:
        assert conn.hello.shared_memory
        item, arena, offset = _place(conn, b"k", len(v1))
        conn._attach(memory, [arena])
        # Replaced while pinned: the old value keeps its buffer until the pins end.
        assert writer.batch_put_views([("k", v2)]) == [True]
        target = bytearray(len(v1))
        assert memory.warm(b"k", arena, offset, len(v1), item.checksum)
        address, warm = memory.source(arena, offset, len(v1), item.checksum)
        assert warm
        assert copy_verified(memoryview(target), address, item.algo, item.checksum, checksummer)
        assert target == v1
        conn.request(p.PingRequest())  # the next frame ends the pins: v1's buffer is free now
        assert writer.batch_put_views([("other", v3)]) == [True]  # a value of that size takes it
        target = bytearray(len(v1))
        assert not copy_verified(memoryview(target), address, item.algo, item.checksum, checksummer)
        assert writer.get("k") == v2 and writer.get("other") == v3
    finally:
        conn.close()
        memory.retire()


def test_a_silent_client_holds_its_pins_no_longer_than_the_bound(start_node, make_client, auth_key_hex, wait_until):
    node = start_node(capacity="8MiB", extra_args=["--max-value-size", "4MiB"])
    writer = make_client([node])
    assert writer.batch_put_views([("a", os.urandom(4 * MiB)), ("b", os.urandom(4 * MiB))]) == [True, True]
    conn = raw_connection(node, auth_key_hex)
    try:
        reply = conn.request(p.ShmGetRequest((b"a", b"b"), (4 * MiB, 4 * MiB)))
        assert [it.status for it in reply.items] == [p.ItemStatus.OK, p.ItemStatus.OK]
        pinned_at = time.monotonic()
        # Both values are pinned by a client that says nothing more: nothing can be evicted.
        assert writer.batch_put_views([("c", os.urandom(4 * MiB))]) == [False]
        wait_until(
            lambda: writer.batch_put_views([("c", b"c" * (4 * MiB))]) == [True],
            p.SHM_PIN_S + 5.0,
            what="the pins to end",
        )
        assert time.monotonic() - pinned_at >= p.SHM_PIN_S * 0.9
        assert writer.get("c") == b"c" * (4 * MiB)
    finally:
        conn.close()


def test_a_node_restarted_on_the_same_port_is_mapped_anew(start_node, make_client, wait_until):
    node = start_node(capacity="128MiB")
    client = make_client([node], shared_memory=True, down_for_s=0.05)
    value = os.urandom(2 * MiB)
    assert client.batch_put_views([("v", value)]) == [True]
    buf = bytearray(len(value))
    assert client.batch_get_into([("v", buf)]) == [True] and buf == value
    (node_client,) = client._nodes
    old = node_client._memory
    assert old is not None and old.arenas >= 1
    node_id = status_of(node)["node_id"]
    fresh = restart_empty(node, capacity="128MiB")
    start_node.nodes.append(fresh)
    assert status_of(fresh)["node_id"] == node_id, "same port, same node_id: only the socket name tells"
    other = os.urandom(2 * MiB)
    wait_until(lambda: client.batch_put_views([("w", other)]) == [True], 10.0, what="a store after the restart")
    buf = bytearray(len(other))
    assert client.batch_get_into([("w", buf)]) == [True] and buf == other
    assert node_client._memory is not old and node_client.shared
    assert old.arenas == 0, "the dead process's memory is no longer mapped here"


def test_shm_requests_are_refused_off_the_same_host_socket(start_node, auth_key_hex):
    node = start_node(capacity="64MiB")
    conn = raw_connection(node, auth_key_hex, local=False)
    try:
        assert not conn.hello.shared_memory
        with pytest.raises(ServerError, match="same-host socket"):
            conn.request(p.ShmGetRequest((b"k",), (MiB,)))
    finally:
        conn.close()
    conn = raw_connection(node, auth_key_hex, local=False)
    try:
        with pytest.raises(ServerError, match="SHM_PUT: this connection was not offered shared memory"):
            conn.request(p.ShmPutRequest((_item(b"k", bytes(MiB)),)))
    finally:
        conn.close()


def test_an_arena_that_is_none_comes_without_a_descriptor(start_node, auth_key_hex):
    node = start_node(capacity="64MiB")
    conn = raw_connection(node, auth_key_hex)
    memory = NodeMemory("test")
    try:
        with pytest.raises(RemoteProtocolError, match="does not give the arenas asked for"):
            conn._attach(memory, [999])
        assert memory.arenas == 0
    finally:
        conn.close()


def test_arenas_that_cannot_be_mapped_turn_shared_memory_off_for_that_node_process(
    start_node, make_client, monkeypatch, caplog
):
    """mmap refused here (vm.max_map_count, address space; or a bad descriptor): the node is not
    marked down, no value is lost, and its values come over the socket from then on."""
    node = start_node(capacity="128MiB")
    client = make_client([node], shared_memory=True)

    def refuse(self, arena, fd, size):
        os.close(fd)
        raise shared.ArenaError(12, f"arena {arena}: mmap failed: Cannot allocate memory")

    monkeypatch.setattr(NodeMemory, "add", refuse)
    values = [(f"k{i}", os.urandom(2 * MiB)) for i in range(3)]
    with caplog.at_level("WARNING", logger="memkv.client"):
        assert client.batch_put_views(values[:1]) == [True]  # SHM_PUT meets the refusal: sent by socket
    assert "shared memory off for this node process: arena 0: mmap failed" in caplog.text
    assert requests_of(node, "put") == 1 and metric(node, "memkv_node_shm_slots_quarantined_total") == 0
    assert client.batch_put_views(values[1:]) == [True, True]
    places = requests_of(node, "shm_put")
    gets = requests_of(node, "get")
    targets = [(key, bytearray(len(value))) for key, value in values]
    assert client.batch_get_into(targets) == [True] * 3
    assert [bytes(buf) for _, buf in targets] == [value for _, value in values]
    assert requests_of(node, "get") == gets + 1 and requests_of(node, "shm_get") == 0
    assert requests_of(node, "shm_put") == places == 1, "no more SHM requests for that process"
    assert requests_of(node, "shm_place") == 0
    assert client.shared_memory_servers() == [] and client.local_servers(), "still the same-host socket"
    assert not any(n.is_down for n in client._nodes)


# -- stores: SHM_PUT and SHM_COMMIT --------------------------------------------------------------


def _item(key: bytes, value: bytes) -> p.PutItem:
    checksummer = Checksummer(bytes(32))
    return p.PutItem(key, len(value), checksummer.algo, checksummer.compute(memoryview(value)))


def test_a_store_writes_large_values_into_the_nodes_memory_and_sends_the_rest(start_node, make_client):
    """The default client writes values of 1 MiB and more into the node's memory itself (one
    copy, no socket); smaller ones go by PUT. Byte-exact for a client that reads over the
    socket, and the writer's own loads copy them with no warm-up of their own."""
    node = start_node(capacity="256MiB")
    writer = make_client([node])
    reader = make_client([node], shared_memory=False)
    values = {f"k{i}": os.urandom(size) for i, size in enumerate([1000, MiB, 3 * MiB + 5, 16 * MiB])}
    view_values = [(key, memoryview(bytearray(value))) for key, value in values.items()]  # vLLM's pool is writable
    assert writer.batch_put_views(view_values) == [True] * len(values)
    assert writer.batch_put_views([("bytes", values["k2"])]) == [True]  # read-only values too
    assert requests_of(node, "shm_put") == 2 and requests_of(node, "shm_commit") == 2
    assert requests_of(node, "put") == 1, "only the 1000-byte value went over the socket"
    assert requests_of(node, "shm_place") == 0, "a value the client wrote itself needs no warm-up"
    assert metric(node, "memkv_node_received_bytes_total") == sum(map(len, values.values())) + len(values["k2"])
    for client in (reader, writer):
        targets = [(key, bytearray(len(value))) for key, value in values.items()]
        assert client.batch_get_into(targets) == [True] * len(values)
        assert all(buf == values[key] for key, buf in targets)
    gets = requests_of(node, "get")
    targets = [(key, bytearray(len(values[key]))) for key in ("k1", "k2", "k3")]
    assert writer.batch_get_into(targets) == [True] * 3 and all(buf == values[key] for key, buf in targets)
    assert requests_of(node, "get") == gets, "the writer copied its own values from shared memory"


def _reserve(conn: NodeConnection, key: bytes, value: bytes) -> p.ShmGetReply:
    reply = conn.request(p.ShmPutRequest((_item(key, value),)))
    assert isinstance(reply, p.ShmGetReply) and reply.opcode == p.Opcode.SHM_PUT
    assert [it.status for it in reply.items] == [p.ItemStatus.OK]
    return reply


def test_an_shm_put_never_committed_is_quarantined_and_never_stored(start_node, make_client, auth_key_hex, wait_until):
    """A client that reserved a slot and then says nothing (stalled, or gone mid-copy): after
    io_timeout_s the node ends the connection, the value is a miss, and the slot never serves
    again (a late write lands in no value)."""
    node = start_node(capacity="64MiB", extra_args=["--io-timeout", "1"])
    client = make_client([node], shared_memory=False)
    value = os.urandom(2 * MiB)
    conn = raw_connection(node, auth_key_hex)
    try:
        _reserve(conn, b"k", value)
        reserved = metric(node, "memkv_node_inflight_bytes")
        assert reserved >= len(value), "the slot is reserved while the client writes"
        wait_until(lambda: metric(node, "memkv_node_shm_slots_quarantined_total") == 1, 10.0, what="the quarantine")
        with pytest.raises(MemKVError):
            conn.request(p.PingRequest())  # the node ended the connection
    finally:
        conn.close()
    assert metric(node, "memkv_node_inflight_bytes") == 0
    assert client.get("k") is None
    assert client.batch_put_views([("k", value)]) == [True] and client.get("k") == value


def test_a_frame_other_than_the_commit_ends_the_connection_and_stores_nothing(start_node, make_client, auth_key_hex):
    node = start_node(capacity="64MiB")
    client = make_client([node], shared_memory=False)
    value = os.urandom(2 * MiB)
    conn = raw_connection(node, auth_key_hex)
    try:
        _reserve(conn, b"k", value)
        with pytest.raises(ServerError, match="PingRequest after an SHM_PUT: the next frame must be its SHM_COMMIT"):
            conn.request(p.PingRequest())
    finally:
        conn.close()
    assert metric(node, "memkv_node_shm_slots_quarantined_total") == 1
    assert client.get("k") is None


def test_a_commit_stores_what_was_written_and_drops_what_was_not(start_node, make_client, auth_key_hex):
    node = start_node(capacity="64MiB")
    client = make_client([node], shared_memory=False)
    written, skipped = os.urandom(2 * MiB), os.urandom(2 * MiB)
    conn = raw_connection(node, auth_key_hex)
    memory = NodeMemory(status_of(node)["local_socket"])
    try:
        reply = conn.request(p.ShmPutRequest((_item(b"w", written), _item(b"s", skipped))))
        assert [it.status for it in reply.items] == [p.ItemStatus.OK, p.ItemStatus.OK]
        conn._attach(memory, sorted(set(reply.arenas)))
        assert memory.use()
        checksummer = Checksummer(bytes(32))
        algo = checksummer.algo
        checksum = memory.write_value(reply.arenas[0], reply.offsets[0], memoryview(bytearray(written)), algo, checksummer)
        assert checksum == checksummer.compute(memoryview(written)), "the checksum of the bytes written"
        with pytest.raises(ValueError, match="not inside a mapped arena"):
            memory.write_value(reply.arenas[0], 1 << 40, memoryview(written), algo, checksummer)
        memory.unuse()
        with pytest.raises(LocalProtocolError, match="flags must be 0 or 1"):
            conn.codec.encode(p.ShmCommitRequest(b"\x02\x01", (checksum, bytes(32))))
        done = conn.request(p.ShmCommitRequest(b"\x01\x00", (checksum, bytes(32))))
        assert done.statuses == bytes([p.ItemStatus.OK, p.ItemStatus.MISS])
        assert isinstance(conn.request(p.PingRequest()), p.PingReply), "the connection goes on"
        with pytest.raises(ServerError, match="SHM_COMMIT of 1 flags for the 0 slots"):
            conn.request(p.ShmCommitRequest(b"\x01", (checksum,)))  # no SHM_PUT before it
    finally:
        conn.close()
        memory.retire()
    assert client.get("w") == written and client.get("s") is None
    assert metric(node, "memkv_node_shm_slots_quarantined_total") == 0
    assert metric(node, "memkv_node_inflight_bytes") == 0


def test_a_commit_whose_checksum_is_not_of_the_bytes_written_is_a_miss_for_every_reader(
    start_node, make_client, auth_key_hex
):
    """The node stores the checksum SHM_COMMIT declares and never looks at the bytes: a client
    that declares the wrong one (a bug, or bytes changed after hashing) stores a value no reader
    accepts (a client with shared memory off, and one with the defaults): a miss, never wrong
    bytes."""
    node = start_node(capacity="64MiB")
    socket_reader = make_client([node], shared_memory=False)
    value = os.urandom(2 * MiB)
    conn = raw_connection(node, auth_key_hex)
    memory = NodeMemory(status_of(node)["local_socket"])
    checksummer = Checksummer(bytes(32))
    try:
        reply = _reserve(conn, b"k", value)
        conn._attach(memory, sorted(set(reply.arenas)))
        assert memory.use()
        memory.write_value(reply.arenas[0], reply.offsets[0], memoryview(value), checksummer.algo, checksummer)
        memory.unuse()
        wrong = checksummer.compute(memoryview(value[:-1] + bytes([value[-1] ^ 1])))
        done = conn.request(p.ShmCommitRequest(b"\x01", (wrong,)))
        assert done.statuses == bytes([p.ItemStatus.OK])
    finally:
        conn.close()
        memory.retire()
    assert socket_reader.get("k") is None
    shm_reader = make_client([node])
    assert shm_reader.batch_get_into([("k", bytearray(len(value)))]) == [False]
