"""A hostile same-host key holder against shared memory (docs/protocol.md section 13, "Trust").

Each test runs a real `memkv serve` and a real client process (tests/security/shm_peer.py) that
speaks the protocol with the key and does to every descriptor it receives what any process can.
Behaviour under test:
* resizing: ftruncate (shrink, grow) and fallocate past the end fail on every memfd a client
  gets, its own reservation included; the node and other clients keep serving byte-exact,
  a remote TCP-only client's PUT of that size included;
* a client that still maps its reservation writable cannot commit it (STILL_MAPPED, counted,
  not stored); a committed value cannot be modified through any descriptor or mapping a client
  has (write, shared writable mmap, mprotect, reopening /proc/self/fd/N read-write, punching a
  hole): another's value nor its own, through the very descriptor it wrote it with;
* memory: a client that stores, maps and reads everything it can leaves what the node holds
  (its memfds' pages, counted in shm_bytes and allocated_bytes) within --capacity, status and
  metrics truthful; reservations are bounded per request (the in-flight bound) and one never
  committed is reclaimed after io_timeout_s (memfds closed, bytes back);
* bounds: memfds fit the descriptor limit beside --max-connections (a WARNING when that leaves
  few); past it SHM_PUT answers NOT_SHARED and the value is stored over the socket;
* uid policy: a client process of another uid is served over the socket and gets no memfd
  (SHM_PUT refused); with `--shared-memory-group` naming its group it gets them.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from memkv import protocol as p
from tests.integration.test_shared_memory import memory_beyond_spares, metric, raw_connection, settled_status, status_of

pytestmark = pytest.mark.integration

MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOBODY = 65534
NODE_WRITES = ["--shared-memory-stores", "node"]


@pytest.fixture
def start_node(start_node):
    """This module's nodes let same-host clients write their own memfds (SHM_PUT) whatever the
    host's huge pages; node-written memfds (`--shared-memory-stores node`) are
    tests/integration/test_node_written_memfds.py's and the last test's here."""

    def start(*args, extra_args=(), **kwargs):
        return start_node(*args, extra_args=["--shared-memory-stores", "client", *extra_args], **kwargs)

    start.nodes = start_node.nodes  # type: ignore[attr-defined]
    return start


def peer(node, auth_key_hex: str, action: str, *args: object, run_as: str = "") -> dict:
    """Run tests/security/shm_peer.py ACTION against `node` (`run_as`: "uid:gid[:groups]", which
    it switches to before connecting): its JSON result."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.security.shm_peer", action, node.host, str(node.port),
         status_of(node)["local_socket"], *map(str, args)],
        cwd=REPO, env={**os.environ, "MEMKV_AUTH_KEY": auth_key_hex, "MEMKV_PEER_AS": run_as},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def holding_peer(node, auth_key_hex: str, action: str, *args: object) -> tuple[subprocess.Popen, dict]:
    """A peer that keeps its descriptors and mappings until its stdin closes."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.security.shm_peer", action, node.host, str(node.port),
         status_of(node)["local_socket"], *map(str, args)],
        cwd=REPO, env={**os.environ, "MEMKV_AUTH_KEY": auth_key_hex}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=10)
        raise AssertionError(proc.stderr.read()[-3000:])
    return proc, json.loads(line)


def node_memfds(node) -> list[tuple[int, int]]:
    """(size, bytes of pages allocated) of every memfd the node process holds open (one entry
    per memfd, however many descriptors of it the node holds)."""
    found = {}
    fd_dir = f"/proc/{node.pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            if not os.readlink(f"{fd_dir}/{name}").startswith("/memfd:memkv-value"):
                continue
            st = os.stat(f"{fd_dir}/{name}")
        except OSError:  # closed meanwhile
            continue
        found[st.st_ino] = (st.st_size, st.st_blocks * 512)
    return list(found.values())


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def test_no_memfd_a_client_gets_can_change_size_and_everyone_keeps_being_served(start_node, make_client, auth_key_hex):
    node = start_node(capacity="64MiB")
    writer = make_client([node])
    remote = make_client([node], local_socket=False)  # TCP only, as from another host
    other = os.urandom(4 * MiB)
    assert writer.batch_put_views([("other", other)]) == [True]
    got = peer(node, auth_key_hex, "resize", "mine", 4 * MiB, "other")
    refused = {"ftruncate_shrink": "EPERM", "ftruncate_grow": "EPERM", "fallocate_grow": "EPERM"}
    assert got["reservation"] == got["after_commit"] == got["other"] == refused
    assert got["commit"] == [p.ItemStatus.OK]
    # The node, a same-host client and a remote one: every value byte-exact, PUTs of that size go on.
    assert writer.get("mine") == remote.get("mine") == b"\xab" * (4 * MiB)
    assert writer.get("other") == remote.get("other") == other
    fresh = [os.urandom(4 * MiB) for _ in range(3)]
    assert remote.batch_put_views([("r0", fresh[0])]) == [True]
    assert writer.batch_put_views([("w1", fresh[1]), ("w2", fresh[2])]) == [True, True]
    for client in (writer, remote):
        targets = [(k, bytearray(4 * MiB)) for k in ("r0", "w1", "w2")]
        assert client.batch_get_into(targets) == [True] * 3
        assert [bytes(b) for _, b in targets] == fresh
    assert node.proc.poll() is None


def test_a_client_still_mapping_its_reservation_writable_cannot_commit_it(start_node, make_client, auth_key_hex):
    node = start_node(capacity="64MiB")
    got = peer(node, auth_key_hex, "keep-mapped", "k", 2 * MiB)
    assert got["commit"] == [p.ItemStatus.STILL_MAPPED]
    reader = make_client([node])
    assert reader.get("k") is None, "not stored: its writer could still change it"
    assert metric(node, "memkv_node_shm_commits_refused_total") == 1
    assert status_of(node)["shared_memory"]["values"] == 0 and memory_beyond_spares(node) == 0


def test_a_committed_value_cannot_be_modified_by_any_descriptor_or_mapping(start_node, make_client, auth_key_hex):
    node = start_node(capacity="64MiB")
    writer = make_client([node])
    value = os.urandom(2 * MiB)
    assert writer.batch_put_views([("theirs", value)]) == [True]
    got = peer(node, auth_key_hex, "modify", "theirs", 2 * MiB, "own")
    assert got["commit"] == [p.ItemStatus.OK]
    for target in ("others_value", "own_value"):
        assert set(got[target].values()) <= {"EPERM", "EACCES"}, (target, got[target])
    for client in (writer, make_client([node], shared_memory=False)):
        assert client.get("theirs") == value
        assert client.get("own") == b"\xef" * (2 * MiB)


def test_what_a_hostile_client_maps_and_reads_stays_within_the_nodes_capacity(start_node, auth_key_hex):
    capacity = 32 * MiB
    node = start_node(capacity="32MiB", extra_args=["--max-value-size", "4MiB"])
    anon_before = rss_anon(node.pid)
    proc, got = holding_peer(node, auth_key_hex, "hold", "h", 4 * MiB, 24)  # 96 MiB stored into 32 MiB
    try:
        assert got["statuses"] == [p.ItemStatus.OK] * 24
        held = node_memfds(node)
        status = status_of(node)
        shm = status["shared_memory"]
        assert len(held) == shm["values"] == 8 and got["mapped"] == 8, "the other 16 were evicted"
        assert sum(size for size, _ in held) == shm["bytes"] == status["allocated_bytes"] <= capacity
        assert sum(pages for _, pages in held) <= capacity
        assert metric(node, "memkv_node_shm_bytes") == shm["bytes"]
        assert metric(node, "memkv_node_allocated_bytes") == status["allocated_bytes"]
        # The node's own memory: nothing a client read or wrote landed there (16 MiB of slack for
        # the interpreter's own allocations while serving).
        assert rss_anon(node.pid) - anon_before < 16 * MiB
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_reservations_are_bounded_and_one_never_committed_is_reclaimed(
    start_node, make_client, auth_key_hex, wait_until
):
    node = start_node(capacity="64MiB", extra_args=["--io-timeout", "1", "--max-value-size", "4MiB"])
    inflight_bound = status_of(node)["max_inflight_bytes"]  # max(2 x max value, capacity / 4)
    proc, got = holding_peer(node, auth_key_hex, "reserve", 4 * MiB, 12)
    try:
        passed = got["passed"]
        assert 1 <= passed <= inflight_bound // (4 * MiB) < 12
        assert got["statuses"].count(p.ItemStatus.OK) == passed
        assert got["statuses"].count(p.ItemStatus.NOT_SHARED) == 12 - passed
        wait_until(
            lambda: metric(node, "memkv_node_shm_reservations_reclaimed_total") == passed, 10.0, what="the reclaim"
        )
        status = settled_status(node)
        spares = status["shared_memory"]["spares"]
        assert len(node_memfds(node)) == spares, "every memfd closed but the spares: what the client maps is its own"
        assert status["allocated_bytes"] == status["shared_memory"]["spare_bytes"]
        assert status["inflight_bytes"] == status["shared_memory"]["pending"] == 0
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    client = make_client([node])
    assert client.get("pending0") is None
    assert client.batch_put_views([("after", b"a" * (4 * MiB))]) == [True] and client.get("after") == b"a" * (4 * MiB)


def _as_nobody(*extra_groups: int) -> str:
    return f"{NOBODY}:{NOBODY}:{','.join(map(str, extra_groups))}"


@pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another uid needs root")
def test_a_client_of_another_uid_is_served_over_the_socket_without_memfds(start_node, make_client, auth_key_hex):
    node = start_node(capacity="64MiB")
    got = peer(node, auth_key_hex, "hello", run_as=_as_nobody())
    assert got["shared_memory"] is False
    assert "SHM_PUT: this connection was not offered shared memory" in got["shm_put"]
    assert got["roundtrip"] is True and got["shared_memory_servers"] == [], "served over the socket"
    assert got["via"] == "local"
    assert status_of(node)["shared_memory"]["values"] == 0
    assert peer(node, auth_key_hex, "hello")["shared_memory"] is True, "the node's own uid: offered"


@pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another uid needs root")
def test_the_shared_memory_group_lets_another_uid_have_memfds(start_node, auth_key_hex):
    group = 4242
    node = start_node(capacity="64MiB", extra_args=["--shared-memory-group", str(group)])
    assert peer(node, auth_key_hex, "hello", run_as=_as_nobody())["shared_memory"] is False, "not in the group"
    got = peer(node, auth_key_hex, "hello", run_as=_as_nobody(group))  # a supplementary group
    assert got["shared_memory"] is True and got["shm_put"] == "ok"
    assert got["shared_memory_servers"] != [] and got["roundtrip"] is True
    got = peer(node, auth_key_hex, "hello", run_as=f"{NOBODY}:{group}")  # the primary group
    assert got["shared_memory"] is True


@pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another uid needs root")
def test_node_written_memfds_go_to_the_nodes_own_uid_only_not_its_group(start_node, auth_key_hex):
    """A peer that keeps the descriptor of a node-written memfd the node has dropped keeps its
    pages, charged to the node: only processes of the node's uid, which could signal the node
    anyway, get them; the group's are served over the socket."""
    group = 4242
    node = start_node(capacity="64MiB", extra_args=["--shared-memory-group", str(group), *NODE_WRITES])
    got = peer(node, auth_key_hex, "hello", run_as=_as_nobody(group))
    assert got["shared_memory"] is False and got["shared_memory_servers"] == []
    assert got["roundtrip"] is True and got["via"] == "local", "served over the same-host socket"
    assert peer(node, auth_key_hex, "hello")["shared_memory"] is True, "the node's own uid: offered"


def test_an_unknown_checksum_algorithm_is_refused_naming_it(start_node, auth_key_hex):
    node = start_node(capacity="64MiB")
    conn = raw_connection(node, auth_key_hex)
    try:
        with pytest.raises(Exception, match="checksum algorithm 9 is not one this node knows"):
            conn.request(p.ShmPutRequest((p.PutItem(b"k", 2 * MiB, 9, bytes(32)),)))
    finally:
        conn.close()
    assert status_of(node)["shared_memory"]["values"] == 0


def test_memfd_values_fit_the_descriptor_limit_and_the_rest_go_over_the_socket(start_node, make_client):
    """The node's memfds are bounded by its descriptor limit beside --max-connections: past the
    bound SHM_PUT answers NOT_SHARED and the client stores over the socket, every value kept."""
    limit, connections = 512, 128

    def low_nofile() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    node = start_node(capacity="256MiB", extra_args=["--max-connections", str(connections)], preexec_fn=low_nofile)
    bound = status_of(node)["shared_memory"]["max_values"]
    assert bound == (limit - connections - 256) // 2 == 64
    assert f"RLIMIT_NOFILE is {limit}: room for only {bound} values in shared memory" in "".join(node.output)
    client = make_client([node])
    values = [(f"v{i}", os.urandom(MiB)) for i in range(bound + 16)]
    assert client.batch_put_views(values) == [True] * len(values)
    shm = settled_status(node)["shared_memory"]
    assert shm["values"] + shm["spares"] == bound, "spares count in the bound too"
    assert metric(node, "memkv_node_shm_puts_refused_total") == len(values) - shm["values"] >= 16
    targets = [(k, bytearray(MiB)) for k, _ in values]
    assert client.batch_get_into(targets) == [True] * len(values)
    assert [bytes(b) for _, b in targets] == [v for _, v in values]


def test_no_client_can_write_or_resize_a_memfd_the_node_writes(start_node, make_client, auth_key_hex):
    """`--shared-memory-stores node`: SHM_GET passes the node's own reused buffer, sealed against
    every write but the node's mapping made before the seal (F_SEAL_FUTURE_WRITE). A key holder
    given it can neither resize it (no SIGBUS for the node or anyone) nor change a byte of it, by
    any descriptor or mapping; every client keeps reading the value byte-exact, stores go on."""
    node = start_node(capacity="64MiB", extra_args=NODE_WRITES)
    writer = make_client([node])
    remote = make_client([node], local_socket=False)
    value = os.urandom(4 * MiB)
    assert writer.batch_put_views([("v", value)]) == [True]
    got = peer(node, auth_key_hex, "modify-node-written", "v", 4 * MiB)
    future_write, seal_write = 0x10, 0x8
    assert got["seals"] & future_write and not got["seals"] & seal_write, "a node-written memfd"
    assert set(got["value"].values()) <= {"EPERM", "EACCES"}, got["value"]
    for client in (writer, remote, make_client([node])):
        out = bytearray(len(value))
        assert client.batch_get_into([("v", out)]) == [True] and out == value
    fresh = [os.urandom(4 * MiB) for _ in range(3)]
    assert remote.batch_put_views([("r", fresh[0])]) == [True]
    assert writer.batch_put_views([("w1", fresh[1]), ("w2", fresh[2])]) == [True, True]
    assert [writer.get(k) for k in ("r", "w1", "w2")] == fresh
    assert node.proc.poll() is None


def test_node_written_memfds_fit_the_descriptor_limit_and_the_rest_are_private(start_node, make_client):
    """Past the memfd bound a node-written buffer is private memory: stored, and loaded over the
    socket (SHM_GET answers NOT_SHARED for it), every value kept."""
    limit, connections = 512, 128

    def low_nofile() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    node = start_node(
        capacity="256MiB", extra_args=["--max-connections", str(connections), *NODE_WRITES], preexec_fn=low_nofile
    )
    bound = status_of(node)["shared_memory"]["max_values"]
    client = make_client([node])
    values = [(f"v{i}", os.urandom(MiB)) for i in range(bound + 16)]
    assert client.batch_put_views(values) == [True] * len(values)
    shm = status_of(node)["shared_memory"]
    assert shm["node_written"] == bound and shm["node_written_bytes"] == bound * MiB
    assert shm["values"] == 0 and metric(node, 'memkv_node_requests_total{op="shm_put"}') == 0
    targets = [(k, bytearray(MiB)) for k, _ in values]
    assert client.batch_get_into(targets) == [True] * len(values)
    assert [bytes(b) for _, b in targets] == [v for _, v in values]
