"""Shared memory for same-host clients (docs/protocol.md section 13, memkv/transport/shm.py,
memkv/client/shared.py, memkv/server/shm.py).

Behaviour under test, against real `memkv serve` processes on 127.0.0.1:
* with `shared_memory` on, a client stores values of 1 MiB and more into memfds the node passes
  (SHM_PUT, SHM_COMMIT) and loads them from there (SHM_GET) byte-exact, with the compiled copy
  loop and with the pure-Python one, xxh3 and blake3 alike; smaller values in the same batch
  come over the socket (NOT_SHARED);
* every client loads such values through shared memory: the writer from the mapping it kept
  (the node passes no descriptor), the others from the memfd the node passes; a value replaced
  by another client comes over the socket once and the stale mapping goes; every byte is
  counted as sent once;
* it is on by default on the client; `shared_memory` off there, or `memkv serve
  --no-shared-memory`, sends no SHM request: values then all come over the socket;
* nothing is pinned: a value replaced or deleted while a client copies it reads its committed
  bytes whole; afterwards a new SHM_GET answers MISS and the node holds no memfd of it; silent
  readers never keep a PUT from storing (it evicts what they read);
* a node restarted on the same port (same node_id) is used anew, and the mappings of the dead
  process are released;
* a connection's way for values (shared memory, or the socket: same-host or TCP) is chosen once,
  when it is opened, and kept for every call on it;
* SHM requests off the same-host socket are refused with an error naming it; memfds this
  process refuses turn shared memory off for that node process, nothing lost;
* SHM_COMMIT must be the frame after SHM_PUT; it stores what was written and drops the rest; a
  wrong declared checksum is a miss for every reader.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time
import urllib.request

import pytest

from memkv import protocol as p
from memkv.client import shared
from memkv.client.node import NodeConnection, local_connect
from memkv.client.shared import SealError, copy_verified, map_value, write_value
from memkv.config import AuthKey, ServerAddress
from memkv.errors import LocalProtocolError, ServerError
from memkv.integrity import Checksummer
from memkv.memfd import unmap
from memkv.transport import shm
from memkv.transport.shm import SharedMemory
from memkv.transport.stream import SocketStream
from tests.faults.nodeops import restart_empty
from tests.integration.test_integrity_counted import integrity_failures

pytestmark = pytest.mark.integration

MiB = 1 << 20


@pytest.fixture
def start_node(start_node):
    """This module's nodes let same-host clients write their own memfds (SHM_PUT) whatever the
    host's huge pages; node-written memfds (`--shared-memory-stores node`) are
    tests/integration/test_node_written_memfds.py's."""

    def start(*args, extra_args=(), **kwargs):
        return start_node(*args, extra_args=["--shared-memory-stores", "client", *extra_args], **kwargs)

    start.nodes = start_node.nodes  # type: ignore[attr-defined]
    return start


def status_of(node) -> dict:
    with urllib.request.urlopen(node.admin_url + "/v1/status", timeout=5) as resp:
        return json.loads(resp.read())


def metric(node, series: str) -> float:
    with urllib.request.urlopen(node.admin_url + "/v1/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = [x for x in text.splitlines() if x.startswith(series + " ")]
    return float(found[0].split()[1]) if found else 0.0


def settled_status(node) -> dict:
    """The node's status once its spares stopped changing (the node faults fresh memfds in for
    the same-host stores to come, counted in allocated_bytes: memkv/server/shm.py)."""
    deadline = time.monotonic() + 10.0
    while True:
        first = status_of(node)
        time.sleep(0.05)
        second = status_of(node)
        keys = [
            (s["allocated_bytes"], s["shared_memory"]["spares"], s["shared_memory"]["spare_bytes"])
            for s in (first, second)
        ]
        if keys[0] == keys[1] or time.monotonic() > deadline:
            return second


def memory_beyond_spares(node) -> int:
    """allocated_bytes less the spares', once they settled."""
    status = settled_status(node)
    return status["allocated_bytes"] - status["shared_memory"]["spare_bytes"]


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
    assert requests_of(node, "shm_get") >= 1 and requests_of(node, "shm_put") >= 1
    assert requests_of(node, "get") > gets_before, "the small values came over the socket (NOT_SHARED)"
    assert status_of(node)["shared_memory"]["values"] == 3
    assert [n.shared for n in client._nodes] == [True]


def test_every_client_loads_shared_values_from_memfds_the_writer_from_its_own_mapping(start_node, make_client):
    node = start_node(capacity="256MiB")
    own, other = (make_client([node], shared_memory=True) for _ in range(2))
    mine, theirs = os.urandom(4 * MiB), os.urandom(4 * MiB)
    sent = metric(node, "memkv_node_sent_bytes_total")
    assert own.batch_put_views([("mine", mine)]) == [True]
    assert other.batch_put_views([("theirs", theirs)]) == [True]
    assert requests_of(node, "shm_put") == 2, "each writer wrote its value into a memfd itself"
    assert metric(node, "memkv_node_sent_bytes_total") == sent, "a store reads nothing"
    (own_node,) = own._nodes
    assert own_node._memory is not None and own_node._memory.mapped == 1, "the writer keeps a mapping"

    def load(client, keys):
        before = {op: requests_of(node, op) for op in ("get", "shm_get")}
        targets = [bytearray(4 * MiB) for _ in keys]
        assert client.batch_get_into(list(zip(keys, targets))) == [True] * len(keys)
        return [bytes(t) for t in targets], {op: requests_of(node, op) - n for op, n in before.items()}

    got, ops = load(own, ["mine", "theirs"])
    assert got == [mine, theirs] and ops == {"shm_get": 1, "get": 0}
    got, ops = load(other, ["mine", "theirs"])
    assert got == [mine, theirs] and ops == {"shm_get": 1, "get": 0}
    assert metric(node, "memkv_node_sent_bytes_total") == sent + 16 * MiB, "each byte counted once"

    replaced = os.urandom(4 * MiB)
    assert other.batch_put_views([("mine", replaced)]) == [True]
    got, ops = load(own, ["mine"])
    assert got == [replaced] and ops == {"shm_get": 1, "get": 1}, "its mapping is of the old value: received"
    assert own_node._memory.mapped == 0, "and the stale mapping is gone"
    got, ops = load(own, ["mine"])
    assert got == [replaced] and ops == {"shm_get": 1, "get": 0}, "then passed as a memfd"


def memfd_mappings() -> int:
    """Mappings of value memfds this process holds (the node names them memkv-value)."""
    with open("/proc/self/maps") as f:
        return sum("memkv-value" in line for line in f)


def test_a_client_busy_in_several_threads_keeps_no_mapping_it_dropped(start_node, make_client):
    """Two threads storing back to back, so that some copy nearly always runs: what a store
    replaces is unmapped all the same, while they run (else the client's memory, and the pages
    the node freed, grow with every store for as long as the client is busy)."""
    node = start_node(capacity="256MiB")
    client = make_client([node], shared_memory=True)
    keys = [f"busy/{i}" for i in range(4)]
    values = [os.urandom(2 * MiB) for _ in keys]
    before = memfd_mappings()
    peak = 0
    running = threading.Event()
    running.set()

    def watch() -> None:
        nonlocal peak
        while running.is_set():
            peak = max(peak, memfd_mappings() - before)
            time.sleep(0.002)

    def work(t: int) -> None:
        for n in range(80):  # bounded: 80 stores per thread
            i = (n + t) % len(keys)
            assert client.batch_put_views([(keys[i], values[i])]) == [True]

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(work, range(2)))
    finally:
        running.clear()
        watcher.join()
    assert requests_of(node, "shm_put") >= 160, "the stores went through shared memory"
    # One kept mapping per key, plus per thread the value it is writing and the one it keeps.
    assert peak <= len(keys) + 2 * 2, f"{peak} memfd mappings at once for {len(keys)} keys"
    assert memfd_mappings() - before <= len(keys)


def test_the_node_keeps_spares_for_the_next_stores_within_their_budget(start_node, make_client, wait_until):
    """After an SHM_PUT of a value size the node faults fresh memfds of that size in ahead
    (spares, capacity / 16 at most: here 16 MiB), counted in allocated_bytes; the next stores
    take them, and what they stored loads byte-exact elsewhere. (`auto`, the default, turns them
    on only where the node may use 4 CPUs or more.)"""
    node = start_node(capacity="256MiB", extra_args=["--shared-memory-spares", "on"])
    client = make_client([node], shared_memory=True)
    first = [(f"a{i}", os.urandom(2 * MiB)) for i in range(2)]
    assert client.batch_put_views(first) == [True] * 2
    wait_until(lambda: status_of(node)["shared_memory"]["spares"] == 8, 10.0, what="8 spares of 2 MiB")
    status = settled_status(node)
    assert status["shared_memory"]["spare_bytes"] == 16 * MiB == metric(node, "memkv_node_shm_spare_bytes")
    assert status["allocated_bytes"] == 4 * MiB + 16 * MiB
    # The first batch's second item may already have found the spare made after its first.
    taken = metric(node, "memkv_node_shm_spares_taken_total")
    second = [(f"b{i}", os.urandom(2 * MiB)) for i in range(4)]
    assert client.batch_put_views(second) == [True] * 4
    assert metric(node, "memkv_node_shm_spares_taken_total") - taken == 4, "every store of the batch took one"
    reader = make_client([node], shared_memory=False)
    for key, value in first + second:
        assert reader.get(key) == value


def test_a_node_with_spares_off_makes_none(start_node, make_client):
    node = start_node(capacity="256MiB", extra_args=["--shared-memory-spares", "off"])
    client = make_client([node], shared_memory=True)
    assert client.batch_put_views([(f"a{i}", os.urandom(2 * MiB)) for i in range(4)]) == [True] * 4
    status = settled_status(node)
    assert status["shared_memory"]["spares"] == 0 and status["allocated_bytes"] == 4 * 2 * MiB
    assert metric(node, "memkv_node_shm_spares_taken_total") == 0


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


@pytest.mark.parametrize(
    ("settings", "way"),
    [({}, SharedMemory), ({"shared_memory": False}, SocketStream), ({"local_socket": False}, SocketStream)],
    ids=["shared-memory", "same-host-socket", "tcp"],
)
def test_a_connection_moves_values_the_way_chosen_when_it_was_opened(
    start_node, make_client, auth_key_hex, settings, way
):
    node = start_node(capacity="128MiB")
    client = make_client([node], **settings)
    value = os.urandom(2 * MiB)
    assert client.batch_put_views([("v", value)]) == [True]
    (node_client,) = client._nodes
    with node_client.connection() as conn:
        chosen = conn.way
    buf = bytearray(len(value))
    assert client.batch_get_into([("v", buf)]) == [True] and buf == value
    with node_client.connection() as again:
        assert again is conn and again.way is chosen, "kept, not chosen again per call"
    assert type(chosen) is way and chosen.conn is conn
    shm_requests = requests_of(node, "shm_put") + requests_of(node, "shm_get")
    assert shm_requests == (2 if way is SharedMemory else 0)
    raw = raw_connection(node, auth_key_hex)  # opened outside a NodeClient: nothing chose its way
    try:
        with pytest.raises(RuntimeError, match="has no way for values"):
            _ = raw.way
    finally:
        raw.close()


def _shm_get(conn: NodeConnection, keys: list[bytes], length: int) -> tuple[p.ShmGetReply, list[int]]:
    return shm.exchange(conn, p.ShmGetRequest(tuple(keys), (length,) * len(keys)))


def node_memfds(node) -> int:
    """Memfds of values the node process holds open."""
    fd_dir = f"/proc/{node.pid}/fd"
    inodes = set()
    for name in os.listdir(fd_dir):
        try:
            if os.readlink(f"{fd_dir}/{name}").startswith("/memfd:memkv-value"):
                inodes.add(os.stat(f"{fd_dir}/{name}").st_ino)
        except OSError:
            pass
    return len(inodes)


def test_a_value_replaced_or_deleted_mid_copy_reads_whole_and_is_gone_after(start_node, make_client, auth_key_hex):
    node = start_node(capacity="256MiB")
    writer = make_client([node])
    v1, v2 = os.urandom(4 * MiB), os.urandom(4 * MiB)
    assert writer.batch_put_views([("k", v1)]) == [True]
    conn = raw_connection(node, auth_key_hex)
    checksummer = Checksummer(AuthKey.from_hex(auth_key_hex, "test").raw)
    try:
        reply, (fd,) = _shm_get(conn, [b"k"], len(v1))
        (item,) = reply.items
        addr = map_value(fd, os.fstat(fd).st_size)
        # Replaced and then deleted while this client holds it: nothing was pinned.
        assert writer.batch_put_views([("k", v2)]) == [True]
        assert writer.delete("k")
        target = bytearray(len(v1))
        assert copy_verified(memoryview(target), addr, item.algo, item.checksum, checksummer)
        assert target == v1, "the committed bytes, whole"
        unmap(addr, os.fstat(fd).st_size)
        os.close(fd)
        reply, fds = _shm_get(conn, [b"k"], len(v1))
        assert [it.status for it in reply.items] == [p.ItemStatus.MISS] and fds == []
    finally:
        conn.close()
    status = settled_status(node)
    assert node_memfds(node) == status["shared_memory"]["spares"], "the node holds no memfd of a deleted value"
    assert status["allocated_bytes"] == status["shared_memory"]["spare_bytes"]


def test_silent_readers_pin_nothing_a_put_still_stores(start_node, make_client, auth_key_hex):
    node = start_node(capacity="8MiB", extra_args=["--max-value-size", "4MiB"])
    writer = make_client([node])
    a, b = os.urandom(4 * MiB), os.urandom(4 * MiB)
    assert writer.batch_put_views([("a", a), ("b", b)]) == [True, True]
    readers = [raw_connection(node, auth_key_hex) for _ in range(4)]
    try:
        for conn in readers:  # each holds both memfds and says nothing more
            reply, fds = _shm_get(conn, [b"a", b"b"], 4 * MiB)
            assert [it.status for it in reply.items] == [p.ItemStatus.OK] * 2 and len(fds) == 2
            for fd in fds:
                os.close(fd)
        assert writer.batch_put_views([("c", b"c" * (4 * MiB))]) == [True], "evicts what they read"
        assert writer.get("c") == b"c" * (4 * MiB)
        assert status_of(node)["allocated_bytes"] <= 8 * MiB
    finally:
        for conn in readers:
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
    assert old is not None and old.mapped >= 1
    node_id = status_of(node)["node_id"]
    fresh = restart_empty(node, capacity="128MiB")
    start_node.nodes.append(fresh)
    assert status_of(fresh)["node_id"] == node_id, "same port, same node_id: only the socket name tells"
    other = os.urandom(2 * MiB)
    wait_until(lambda: client.batch_put_views([("w", other)]) == [True], 10.0, what="a store after the restart")
    buf = bytearray(len(other))
    assert client.batch_get_into([("w", buf)]) == [True] and buf == other
    assert node_client._memory is not old and node_client.shared
    assert old.mapped == 0, "the dead process's memory is no longer mapped here"


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


def test_memfds_refused_here_turn_shared_memory_off_for_that_node_process(start_node, make_client, monkeypatch, caplog):
    """A memfd this process refuses (not sealed as it must be, mmap refused): the node is not
    marked down, no value is lost, and its values come over the socket from then on."""
    node = start_node(capacity="128MiB")
    client = make_client([node], shared_memory=True)

    def refuse(fd, length, seals=shared.SEALS_NEEDED):
        raise SealError(1, "a memfd without its seals (has 0x0, needs 0xc)")

    monkeypatch.setattr(shared, "check_sealed", refuse)
    monkeypatch.setattr(shm, "check_loadable", refuse)
    values = [(f"k{i}", os.urandom(2 * MiB)) for i in range(3)]
    with caplog.at_level("WARNING", logger="memkv.client"):
        assert client.batch_put_views(values[:1]) == [True]  # SHM_PUT meets the refusal: sent by socket
    assert "shared memory off for this node process: a memfd without its seals" in caplog.text
    assert requests_of(node, "put") == 1 and status_of(node)["shared_memory"]["values"] == 0
    assert client.batch_put_views(values[1:]) == [True, True]
    gets = requests_of(node, "get")
    targets = [(key, bytearray(len(value))) for key, value in values]
    assert client.batch_get_into(targets) == [True] * 3
    assert [bytes(buf) for _, buf in targets] == [value for _, value in values]
    assert requests_of(node, "get") == gets + 1 and requests_of(node, "shm_get") == 0
    assert requests_of(node, "shm_put") == 1, "no more SHM requests for that process"
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
    assert metric(node, "memkv_node_received_bytes_total") == sum(map(len, values.values())) + len(values["k2"])
    for client in (reader, writer):
        targets = [(key, bytearray(len(value))) for key, value in values.items()]
        assert client.batch_get_into(targets) == [True] * len(values)
        assert all(buf == values[key] for key, buf in targets)
    gets = requests_of(node, "get")
    targets = [(key, bytearray(len(values[key]))) for key in ("k1", "k2", "k3")]
    assert writer.batch_get_into(targets) == [True] * 3 and all(buf == values[key] for key, buf in targets)
    assert requests_of(node, "get") == gets, "the writer copied its own values from its mappings"


def _reserve(conn: NodeConnection, items: list[tuple[bytes, bytes]]) -> list[int]:
    reply, fds = shm.exchange(conn, p.ShmPutRequest(tuple(_item(k, v) for k, v in items)))
    assert [it.status for it in reply.items] == [p.ItemStatus.OK] * len(items) and len(fds) == len(items)
    return fds


def test_a_frame_other_than_the_commit_ends_the_connection_and_stores_nothing(start_node, make_client, auth_key_hex):
    node = start_node(capacity="64MiB")
    client = make_client([node], shared_memory=False)
    value = os.urandom(2 * MiB)
    conn = raw_connection(node, auth_key_hex)
    try:
        (fd,) = _reserve(conn, [(b"k", value)])
        os.close(fd)
        with pytest.raises(ServerError, match="PingRequest after an SHM_PUT: the next frame must be its SHM_COMMIT"):
            conn.request(p.PingRequest())
    finally:
        conn.close()
    assert client.get("k") is None
    assert metric(node, "memkv_node_shm_reservations_reclaimed_total") == 1
    assert memory_beyond_spares(node) == 0


def test_a_commit_stores_what_was_written_and_drops_what_was_not(start_node, make_client, auth_key_hex):
    node = start_node(capacity="64MiB")
    client = make_client([node], shared_memory=False)
    written, skipped = os.urandom(2 * MiB), os.urandom(2 * MiB)
    conn = raw_connection(node, auth_key_hex)
    checksummer = Checksummer(bytes(32))
    try:
        fd_w, fd_s = _reserve(conn, [(b"w", written), (b"s", skipped)])
        os.close(fd_s)
        checksum, kept = write_value(fd_w, memoryview(bytearray(written)), checksummer.algo, checksummer, keep=False)
        assert checksum == checksummer.compute(memoryview(written)) and kept is None, (
            "the checksum of the bytes written"
        )
        with pytest.raises(LocalProtocolError, match="flags must be 0 or 1"):
            conn.codec.encode(p.ShmCommitRequest(b"\x02\x01", (checksum, bytes(32))))
        done = conn.request(p.ShmCommitRequest(b"\x01\x00", (checksum, bytes(32))))
        assert done.statuses == bytes([p.ItemStatus.OK, p.ItemStatus.MISS])
        assert isinstance(conn.request(p.PingRequest()), p.PingReply), "the connection goes on"
        with pytest.raises(ServerError, match="SHM_COMMIT of 1 flags for the 0 memfds"):
            conn.request(p.ShmCommitRequest(b"\x01", (checksum,)))  # no SHM_PUT before it
    finally:
        conn.close()
    assert client.get("w") == written and client.get("s") is None
    assert metric(node, "memkv_node_inflight_bytes") == 0
    assert status_of(node)["shared_memory"]["values"] == 1 and status_of(node)["shared_memory"]["pending"] == 0


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
    checksummer = Checksummer(bytes(32))
    try:
        (fd,) = _reserve(conn, [(b"k", value)])
        write_value(fd, memoryview(value), checksummer.algo, checksummer, keep=False)
        wrong = checksummer.compute(memoryview(value[:-1] + bytes([value[-1] ^ 1])))
        done = conn.request(p.ShmCommitRequest(b"\x01", (wrong,)))
        assert done.statuses == bytes([p.ItemStatus.OK])
    finally:
        conn.close()
    assert socket_reader.get("k") is None
    shm_reader = make_client([node])
    server = f"{node.host}:{node.port}"
    before = integrity_failures(server)
    assert shm_reader.batch_get_into([("k", bytearray(len(value)))]) == [False]
    assert shm_reader.shared_memory_servers() == [server], "copied from the value's memfd"
    assert integrity_failures(server) == before + 1, "a copy that fails its checksum is counted"
    assert [h["up"] for h in shm_reader.health()] == [True], "a checksum failure is not a node failure"


@pytest.fixture
def shmem_huge_pages():
    """Sets the host's transparent-huge-page mode for shared memory for one test, then puts back
    what was there (root only; skips where the file cannot be written)."""
    from memkv.memfd import SHMEM_THP
    from memkv.memfd import shmem_huge_pages as mode_now

    before = mode_now()
    if before is None or not os.access(SHMEM_THP, os.W_OK):
        pytest.skip(f"{SHMEM_THP} cannot be changed here")

    def set_mode(mode: str) -> None:
        with open(SHMEM_THP, "w") as f:
            f.write(mode)
        assert mode_now() == mode

    try:
        yield set_mode
    finally:
        set_mode(before)


def shmem_huge_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("ShmemHugePages:"))


def test_values_stored_through_shared_memory_get_huge_pages_where_the_host_allows(
    start_node, make_client, shmem_huge_pages
):
    """A fresh memfd per value needs its page tables filled on every store: with 4 KiB pages that
    cost more than the copy. Where the host allows huge pages for shared memory ("advise"), the
    writer asks for them: the value's memory is in 2 MiB pages, and it still loads byte-exact."""
    shmem_huge_pages("advise")
    node = start_node(capacity="128MiB")
    client = make_client([node])
    value = os.urandom(16 * MiB)
    before = shmem_huge_bytes()
    assert client.batch_put_views([("huge", value)]) == [True]
    assert client.shared_memory_servers() == [f"{node.host}:{node.port}"]
    assert shmem_huge_bytes() - before >= 14 * MiB, "the stored value's memfd is in huge pages"
    out = bytearray(len(value))
    assert client.batch_get_into([("huge", out)]) == [True] and out == value


def test_the_node_warns_at_start_when_the_host_keeps_shared_memory_off_huge_pages(
    start_node, make_client, shmem_huge_pages, wait_until
):
    warning = "transparent huge pages for shared memory are 'never'"
    shmem_huge_pages("never")
    warned = start_node(capacity="64MiB")
    wait_until(lambda: any(warning in line for line in warned.output), 10.0, what="the warning")
    shmem_huge_pages("advise")
    quiet = start_node(capacity="64MiB")
    make_client([quiet]).exists([b"k"])  # answered: the node is serving, its start lines are out
    assert not any("transparent huge pages" in line for line in quiet.output), quiet.output


def test_a_value_gone_from_the_node_is_a_miss_not_a_checksum_failure(start_node, make_client):
    """A key the node does not hold (never stored, or deleted while this process still maps the
    value it stored) is a plain miss on the shared-memory path: not counted as an integrity
    failure, as it is not one (fleet loads hit this whenever a store was refused NO_SPACE)."""
    node = start_node(capacity="64MiB")
    client = make_client([node])
    server = f"{node.host}:{node.port}"
    assert client.batch_put_views([("kept", os.urandom(2 * MiB))]) == [True]
    assert client.shared_memory_servers() == [server]
    assert client.delete(["kept"]) == [True]
    before = integrity_failures(server)
    out = bytearray(2 * MiB)
    assert client.batch_get_into([("kept", out), ("never", bytearray(2 * MiB))]) == [False, False]
    assert integrity_failures(server) == before, "a miss is not an integrity failure"
