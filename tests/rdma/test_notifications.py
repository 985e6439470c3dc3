"""RDMA notifications reach the loader that waits for them; the client releases everything on close.

Behaviour under test (real NIXL agents over UCX tcp and cma on loopback, real `memkv serve` nodes):
* the client's notification inbox hands each notification to the ticket it belongs to, in any
  arrival order and to concurrent waiters; a ticket whose notification never comes returns
  False at its deadline; a notification that comes late (its waiter gave up), twice, or with a
  token nobody expects is dropped and counted, and the next ticket still works;
* closing the inbox wakes a waiting loader with False and refuses new tickets;
* loads from many threads at once over RDMA all land byte-exact and leave no ticket behind;
* closing the client closes the inbox, deregisters the pool, drops the agent and leaves no
  thread of its own running;
* a node loads a client's metadata into NIXL once, however many of the client's connections
  attach (the later attaches only count), and loads it again after the client went away.
"""

from __future__ import annotations

import mmap
import random
import struct
import threading
import time

import pytest

from memkv.errors import RdmaError
from memkv.nixl_adapter import NixlAgent, buffer_address
from memkv.transport.rdma import _NotifInbox
from tests.rdma.conftest import requires_nixl, wait_for

pytestmark = [pytest.mark.integration, requires_nixl]

MiB = 1 << 20


class Pair:
    """A client agent with a registered region and a "node" agent that WRITEs into it with a
    notification, both in this process (the same NIXL calls the node makes)."""

    def __init__(self) -> None:
        self.client = NixlAgent("client")
        self.node = NixlAgent("node")
        self._dst = mmap.mmap(-1, 4 * MiB)
        self._src = mmap.mmap(-1, MiB)
        self.dst, self.src = memoryview(self._dst), memoryview(self._src)
        self.dst_reg = self.client.register(buffer_address(self.dst), len(self.dst))
        self.src_reg = self.node.register(buffer_address(self.src), len(self.src))
        self.peer = self.node.add_peer(self.client.metadata())
        self.node_name = self.node.name

    def notify(self, token: int, slot: int = 0) -> None:
        """WRITE 4 KiB into `slot` with notification `token`; returns once the write completed."""
        w = self.node.write(
            [(buffer_address(self.src), 4096)],
            [(buffer_address(self.dst) + slot * 4096, 4096)],
            self.peer,
            struct.pack(">Q", token),
        )
        try:
            deadline = time.monotonic() + 10
            while w.state() == "PROC":
                assert time.monotonic() < deadline, "the write did not complete"
                time.sleep(0.001)
            assert w.state() == "DONE"
        finally:
            w.release()

    def close(self) -> None:
        self.node.close()
        self.client.deregister(self.dst_reg)
        self.client.close()
        self.dst.release()
        self.src.release()


@pytest.fixture
def pair(ucx):
    pair = Pair()
    try:
        yield pair
    finally:
        pair.close()


def tok(n: int) -> bytes:
    return struct.pack(">Q", n)


def test_each_notification_reaches_its_own_waiter_in_any_order(pair):
    inbox = _NotifInbox(pair.client)
    a, b = inbox.expect(pair.node_name, tok(1)), inbox.expect(pair.node_name, tok(2))
    other = inbox.expect("memkv-node-someone-else", tok(2))  # same token, another peer
    pair.notify(2)
    assert inbox.wait(b, time.monotonic() + 10) is True
    assert not a.event.is_set() and not other.event.is_set()
    pair.notify(1, slot=1)
    assert inbox.wait(a, time.monotonic() + 10) is True
    assert inbox.wait(other, time.monotonic() + 0.2) is False  # nothing came from that peer
    assert inbox.dropped == 0 and inbox.expected == 0


def test_concurrent_waiters_each_get_theirs(pair):
    inbox = _NotifInbox(pair.client)
    tickets = [inbox.expect(pair.node_name, tok(100 + i)) for i in range(8)]
    results: dict[int, bool] = {}

    def waiter(i: int) -> None:
        results[i] = inbox.wait(tickets[i], time.monotonic() + 20)

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    order = list(range(8))
    random.Random(3).shuffle(order)
    for i in order:
        pair.notify(100 + i, slot=i)
    for t in threads:
        t.join(30)
    assert results == {i: True for i in range(8)}
    assert inbox.dropped == 0 and inbox.expected == 0


def test_a_missing_notification_times_out_and_a_late_or_duplicate_one_is_harmless(pair):
    inbox = _NotifInbox(pair.client)
    missing = inbox.expect(pair.node_name, tok(7))
    t = time.monotonic()
    assert inbox.wait(missing, t + 0.3) is False
    assert time.monotonic() - t < 5  # returned at its deadline, not at some NIXL timeout
    assert inbox.expected == 0
    pair.notify(7)  # late: its waiter gave up
    pair.notify(99, slot=1)  # a token nobody expects
    nxt = inbox.expect(pair.node_name, tok(8))
    pair.notify(8, slot=2)
    pair.notify(8, slot=2)  # the same notification twice
    assert inbox.wait(nxt, time.monotonic() + 10) is True
    later = inbox.expect(pair.node_name, tok(9))
    pair.notify(9, slot=3)
    assert inbox.wait(later, time.monotonic() + 10) is True  # reads whatever is left, drops it
    assert wait_for(lambda: inbox.dropped == 3, 2.0), inbox.dropped  # 7 (late), 99 (unknown), 8 (again)


def test_close_wakes_a_waiting_loader_and_refuses_new_tickets(pair):
    inbox = _NotifInbox(pair.client)
    ticket = inbox.expect(pair.node_name, tok(5))
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(inbox.wait(ticket, time.monotonic() + 30)))
    waiter.start()
    time.sleep(0.1)
    t = time.monotonic()
    inbox.close()
    waiter.join(10)
    assert got == [False] and time.monotonic() - t < 5
    with pytest.raises(RdmaError, match="closed"):
        inbox.expect(pair.node_name, tok(6))


def test_loads_from_many_threads_land_and_leave_no_ticket(ucx, start_node, make_client, pool):
    nodes = start_node.many(2)
    client = make_client(nodes, transport="rdma", io_timeout_s=10.0)
    assert client.register_pool(pool)
    rng = random.Random(11)
    values = {f"notif/{i}": rng.randbytes(MiB) for i in range(32)}
    assert client.batch_put_views(list(values.items())) == [True] * len(values)
    keys = list(values)
    slots = {k: pool[i * MiB : (i + 1) * MiB] for i, k in enumerate(keys)}
    errors: list[object] = []

    def load(part: list[str]) -> None:
        for k in part:  # one RDMA_GET per key and thread: many waits at once
            r = client.batch_load_into([(k, slots[k])])
            if r.ok != [True] or r.may_land_late:
                errors.append((k, r))

    threads = [threading.Thread(target=load, args=(keys[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert all(bytes(slots[k]) == v for k, v in values.items())
    inbox = client._transport._inbox
    assert inbox.expected == 0 and inbox.dropped == 0


def test_close_releases_the_pool_and_the_agent_and_leaves_no_thread(ucx, start_node, make_client, pool):
    (node,) = start_node.many(1)
    before = set(threading.enumerate())
    client = make_client([node], transport="rdma", io_timeout_s=10.0)
    assert client.register_pool(pool)
    client.put("notif/close", b"v" * 4096)
    assert client.batch_load_into([("notif/close", pool[:4096])]).ok == [True]
    transport = client._transport
    inbox = transport._inbox
    client.close()
    assert transport._agent is None and transport._pool is None and transport._inbox is None
    assert not transport.rdma_active
    with pytest.raises(RdmaError, match="closed"):
        inbox.expect("anyone", tok(1))
    left = wait_for(lambda: not [t for t in threading.enumerate() if t not in before and t.is_alive()], 10.0)
    assert left, [t.name for t in threading.enumerate() if t not in before]


def test_node_loads_a_clients_metadata_once_for_all_its_connections(ucx, start_node, make_client, pool):
    node = start_node(env={"MEMKV_LOG_LEVEL": "info"})
    client = make_client([node], transport="rdma", io_timeout_s=10.0)
    assert client.register_pool(pool)
    values = {f"attach/{i}": bytes([i]) * 65536 for i in range(16)}
    assert client.batch_put_views(list(values.items())) == [True] * len(values)
    keys = list(values)
    slots = {k: pool[i * 65536 : (i + 1) * 65536] for i, k in enumerate(keys)}
    barrier = threading.Barrier(4)
    oks: list[bool] = []

    def load(part: list[str]) -> None:
        barrier.wait(10)  # at once: the client opens (and attaches) more connections
        for k in part:
            oks.extend(client.batch_load_into([(k, slots[k])]).ok)

    threads = [threading.Thread(target=load, args=(keys[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert oks == [True] * len(keys) and all(bytes(slots[k]) == v for k, v in values.items())
    name = client._transport._agent.name

    def attaches() -> tuple[int, int]:
        lines = [line for line in node.output if f"{name} attached" in line]
        return (
            sum("(metadata loaded)" in line for line in lines),
            sum("(metadata already loaded)" in line for line in lines),
        )

    assert wait_for(lambda: attaches()[1] >= 1, 5.0), "".join(node.output)[-3000:]
    assert attaches()[0] == 1  # NIXL loaded it once
    client.close()
    assert wait_for(lambda: any(f"{name} detached" in line for line in node.output), 10.0)
    again = make_client([node], transport="rdma", io_timeout_s=10.0)  # a new agent: loaded afresh
    assert again.register_pool(pool)
    assert again.batch_load_into([(keys[0], slots[keys[0]])]).ok == [True]
    new = again._transport._agent.name
    assert wait_for(lambda: any(f"{new} attached" in line and "(metadata loaded)" in line for line in node.output), 5.0)
