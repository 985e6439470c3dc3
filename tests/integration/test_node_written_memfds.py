"""Node-written memfds (`memkv serve --shared-memory-stores node`, the default where the host gives
shared memory no huge pages; memkv/server/shm.py, docs/protocol.md section 13).

Behaviour under test, against real `memkv serve` processes on 127.0.0.1:
* HELLO_OK says `shm_put` false; a same-host client stores over the socket (no SHM_PUT) into
  buffers that are memfds of the node's, counted in `allocated_bytes` and the status's
  `node_written_bytes`; every client, the writer included, loads them through SHM_GET from the
  memfd the node passes, byte-exact, with no value bytes sent over the socket; smaller values
  come over the socket; a value stored over TCP (another host) gets private memory;
* the node reuses those memfds value after value: a full node that keeps storing makes no new
  memfd (no fresh pages: the reason for the mode);
* a memfd that holds another value by the time a client reads it (the node reused it) is not
  trusted: the client takes that key over the socket (the key's current value, or a miss) and
  counts no integrity failure;
* `auto` picks client-written memfds where the host gives shared memory huge pages on advice
  and node-written ones where it does not, and says which at start; a bad mode is an error
  naming the option.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from memkv import protocol as p
from memkv.client.shared import MappedValues
from memkv.config import AuthKey
from memkv.integrity import Checksummer
from memkv.transport import shm
from memkv.transport.shm import SharedMemory
from tests.integration.test_integrity_counted import integrity_failures
from tests.integration.test_shared_memory import metric, raw_connection, requests_of, shmem_huge_pages, status_of

pytestmark = pytest.mark.integration
__all__ = ["shmem_huge_pages"]  # a fixture of this module's too

MiB = 1 << 20
NODE_WRITES = ["--shared-memory-stores", "node"]


def sent_bytes(node) -> float:
    return metric(node, "memkv_node_sent_bytes_total")


def test_stores_go_over_the_socket_into_node_memfds_and_every_client_loads_from_them(
    start_node, make_client, auth_key_hex
):
    node = start_node(capacity="256MiB", extra_args=NODE_WRITES)
    conn = raw_connection(node, auth_key_hex)
    try:
        assert conn.hello.shared_memory and not conn.hello.shm_put
    finally:
        conn.close()
    writer = make_client([node])
    values = {f"k{i}": os.urandom(size) for i, size in enumerate([4096, 1 * MiB, 3 * MiB + 5, 16 * MiB])}
    assert writer.batch_put_views(list(values.items())) == [True] * len(values)
    assert requests_of(node, "shm_put") == 0 and requests_of(node, "put") >= 1
    shm_status = status_of(node)["shared_memory"]
    big = [len(v) for v in values.values() if len(v) >= p.SHM_MIN_VALUE]
    page = os.sysconf("SC_PAGE_SIZE")
    assert shm_status["node_written"] == len(big) and shm_status["values"] == 0
    assert shm_status["node_written_bytes"] == sum(-(-n // page) * page for n in big)
    assert shm_status["node_written_bytes"] <= status_of(node)["allocated_bytes"]
    for client in (writer, make_client([node])):
        sent_before = sent_bytes(node)
        targets = [(key, bytearray(len(value))) for key, value in values.items()]
        assert client.batch_get_into(targets) == [True] * len(values)
        assert all(buf == values[key] for key, buf in targets)
        over_socket = sent_bytes(node) - sent_before
        assert over_socket < 2 * 4096 + sum(big), "the large values came through their memfds"
    assert requests_of(node, "shm_get") >= 2
    # A value from another host stays in private memory (a node's first fill needs its huge
    # pages); same-host clients load it over the socket.
    remote = make_client([node], local_socket=False)
    far = os.urandom(4 * MiB)
    assert remote.batch_put_views([("far", far)]) == [True]
    assert status_of(node)["shared_memory"]["node_written"] == len(big), "no memfd for it"
    out = bytearray(len(far))
    assert writer.batch_get_into([("far", out)]) == [True] and out == far


def test_a_full_node_reuses_its_memfds_value_after_value(start_node, make_client):
    node = start_node(capacity="32MiB", extra_args=[*NODE_WRITES, "--max-value-size", "4MiB"])
    client = make_client([node])
    assert client.batch_put_views([(f"a{i}", os.urandom(4 * MiB)) for i in range(8)]) == [True] * 8
    first = {ino for ino, _ in node_memfd_inodes(node)}
    assert len(first) == 8
    later = [(f"b{i}", os.urandom(4 * MiB)) for i in range(24)]  # evicts the a's, then each other
    for i in range(0, len(later), 4):
        assert client.batch_put_views(later[i : i + 4]) == [True] * 4
    assert {ino for ino, _ in node_memfd_inodes(node)} == first, "no new memfd: no fresh pages"
    out = bytearray(4 * MiB)
    assert client.batch_get_into([(later[-1][0], out)]) == [True] and out == later[-1][1]
    assert status_of(node)["allocated_bytes"] <= 32 * MiB


def node_memfd_inodes(node) -> list[tuple[int, int]]:
    """(inode, size) of each memfd the node holds."""
    found = {}
    fd_dir = f"/proc/{node.pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            if os.readlink(f"{fd_dir}/{name}").startswith("/memfd:memkv-value"):
                st = os.stat(f"{fd_dir}/{name}")
                found[st.st_ino] = st.st_size
        except OSError:  # closed meanwhile
            continue
    return list(found.items())


@pytest.mark.parametrize("then", ["deleted", "replaced"])
def test_a_memfd_reused_before_the_read_sends_the_client_to_the_socket(start_node, make_client, auth_key_hex, then):
    """SHM_GET pins nothing: between the reply and the read, the node may give the value's buffer
    to another value. The bytes read then fail the value's check; the client GETs the key
    instead (its current value, or a miss) and counts no integrity failure."""
    # Deleted: its buffer goes to the pool (1/8 of 64 MiB) and the next store takes it. Replaced:
    # a full node's store of the same key takes the old value's buffer.
    capacity = "64MiB" if then == "deleted" else "8MiB"
    node = start_node(capacity=capacity, extra_args=[*NODE_WRITES, "--max-value-size", "4MiB"])
    client = make_client([node])
    server = f"{node.host}:{node.port}"
    size = 4 * MiB
    old = os.urandom(size)
    assert client.batch_put_views([("k", old), ("filler", os.urandom(size))]) == [True, True]
    conn = raw_connection(node, auth_key_hex)
    try:
        reply, (fd,) = shm.exchange(conn, p.ShmGetRequest((b"k",), (size,)))
        (item,) = reply.items
        assert item.status == p.ItemStatus.OK
        inode = os.fstat(fd).st_ino
        new = os.urandom(size)
        if then == "deleted":
            assert client.delete(["k"]) == [True]
            assert client.batch_put_views([("other", new)]) == [True]  # takes the pooled buffer
        else:
            assert client.batch_put_views([("k", new)]) == [True]  # a full store reuses the old buffer
        assert os.pread(fd, 64, 0) == new[:64], "the node put the new value into the very memfd"
        assert inode in {ino for ino, _ in node_memfd_inodes(node)}
        before = integrity_failures(server)
        way = SharedMemory(conn, MappedValues("test"))
        checksummer = Checksummer(AuthKey.from_hex(auth_key_hex, "test").raw)
        assert way._copy(b"k", item, fd, memoryview(bytearray(size)), checksummer) is None, "take the socket"
        os.close(fd)
        out = bytearray(size)
        got = client.batch_get_into([("k", out)])
        assert got == ([False] if then == "deleted" else [True])
        if then == "replaced":
            assert out == new
        assert integrity_failures(server) == before
    finally:
        conn.close()


@pytest.mark.parametrize(("thp", "stores"), [("advise", "the clients (SHM_PUT)"), ("never", "the node")])
def test_auto_lets_clients_write_only_where_shared_memory_gets_huge_pages(
    start_node, make_client, shmem_huge_pages, wait_until, thp, stores
):
    shmem_huge_pages(thp)
    node = start_node(capacity="64MiB")
    wait_until(lambda: any("same-host clients connect to" in line for line in node.output), 10.0, what="start line")
    line = next(x for x in node.output if "same-host clients connect to" in x)
    assert line.rstrip().endswith(f"stored by {stores})"), line
    assert not any("transparent huge pages" in x for x in node.output), "auto never picks the slow way"
    client = make_client([node])
    value = os.urandom(2 * MiB)
    assert client.batch_put_views([("v", value)]) == [True]
    assert requests_of(node, "shm_put") == (1 if thp == "advise" else 0)
    assert client.get("v") == value


def test_a_bad_stores_mode_is_refused_naming_the_option():
    proc = subprocess.run(
        [sys.executable, "-m", "memkv", "serve", "--capacity", "64MiB", "--shared-memory-stores", "both"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "MEMKV_AUTH_KEY": "00" * 32},
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--shared-memory-stores" in proc.stderr and "'both'" in proc.stderr
