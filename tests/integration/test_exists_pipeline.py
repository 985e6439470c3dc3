"""EXISTS answers are taken per node as they arrive: a stopped node holds only its own keys.

Behaviour under test, with three real nodes on 127.0.0.1, one of them SIGSTOPped (and always
continued in `finally`):

* `Client.exists(keys, on_answer=...)` delivers the healthy nodes' answers (all hits) while the
  stopped node's keys are still unanswered, long before the client's io_timeout_s; the stopped
  node's keys then answer False at io_timeout_s and it is marked down, as before;
* the same when the client has no pooled connection yet: the connect to the stopped node (its
  handshake never completes) runs off the calling thread and holds no other node's answers;
* `exists(..., timeout_s=...)` returns at that deadline with the healthy nodes' answers and
  False for the silent node, without marking it down; the abandoned connection is closed, never
  reused half-read: once the node continues, every answer is right again;
* `Client.exists_stream()`: a second round submitted while the stopped node still owes the
  first is answered at once for the healthy nodes too; the stopped node's keys of both rounds
  answer False when its io_timeout_s passes; after SIGCONT the same stream answers them again.
* replies that arrive a byte at a time, several pipelined on one connection (a node whose
  max_batch cuts the batch into requests), are assembled exactly, and the connection goes back
  to the pool in step (the next call reuses it).

Timing claims are orderings plus generous bounds (this box has 2 busy cores). Every wait is a
deadline-bounded poll; every loop is bounded by a count and a deadline.
"""

from __future__ import annotations

import signal
import time

import pytest

from memkv import protocol as p
from tests.conftest import build_client
from tests.faults.fakenode import FakeConnection, FakeNode
from tests.faults.nodeops import all_threads_stopped

pytestmark = pytest.mark.integration

IO_TIMEOUT_S = 4.0  # the client's: the stopped node's keys answer False after this
HEALTHY_BY_S = IO_TIMEOUT_S / 2  # the healthy nodes' answers must all be in well before it
MARGIN_S = 3.0


def keys_by_node(client, nodes, prefix: str, per_node: int, search: int = 2000) -> dict[str, list[str]]:
    """`per_node` deterministic keys owned by each node, by node address (bounded search)."""
    out: dict[str, list[str]] = {n.address: [] for n in nodes}
    for i in range(search):
        key = f"{prefix}/{i}"
        bucket = out[client.owner(key).name]
        if len(bucket) < per_node:
            bucket.append(key)
        if all(len(b) == per_node for b in out.values()):
            return out
    raise AssertionError(f"no key spread found in {search} candidates")


class Recorder:
    """An on_answer callback that notes when each key was answered, and how."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.started = time.monotonic()
        self.answers: dict[str, tuple[bool, float]] = {}
        self.order: list[str] = []

    def __call__(self, indices: list[int], hits: list[bool]) -> None:
        now = time.monotonic() - self.started
        for i, hit in zip(indices, hits):
            key = self.keys[i]
            assert key not in self.answers, f"{key} answered twice"
            self.answers[key] = (hit, now)
            self.order.append(key)


def stop(node, wait_until) -> None:
    node.signal(signal.SIGSTOP)
    wait_until(lambda: all_threads_stopped(node.pid), 5.0, what="the node's threads to stop")


@pytest.fixture
def cluster(start_node, make_client):
    """Three nodes, a client with a long io_timeout_s, and 2 stored keys owned by each node."""
    nodes = start_node.many(3, capacity="64MiB")
    client = make_client(nodes, io_timeout_s=IO_TIMEOUT_S, connect_timeout_s=2.0, down_for_s=0.5)
    by_node = keys_by_node(client, nodes, "pipe", per_node=2)
    stored = [k for ks in by_node.values() for k in ks]
    assert client.batch_put_views([(k, k.encode() * 10) for k in stored]) == [True] * len(stored)
    return nodes, client, by_node


def test_exists_hands_over_healthy_nodes_answers_while_a_stopped_node_is_silent(cluster, wait_until):
    nodes, client, by_node = cluster
    stopped = nodes[0]
    silent = by_node[stopped.address]
    keys = [k for ks in by_node.values() for k in ks]
    healthy = [k for k in keys if k not in silent]
    stop(stopped, wait_until)
    try:
        rec = Recorder(keys)
        found = client.exists(keys, on_answer=rec)
        took = time.monotonic() - rec.started
        down = not next(h["up"] for h in client.health() if h["server"] == stopped.address)
    finally:
        stopped.signal(signal.SIGCONT)
    assert sorted(rec.answers) == sorted(keys), "every key is answered exactly once"
    assert rec.order[: len(healthy)] == [k for k in rec.order if k in healthy], (
        f"a silent key was answered before a healthy one: {rec.order}"
    )
    assert all(rec.answers[k][0] for k in healthy)
    worst_healthy = max(rec.answers[k][1] for k in healthy)
    assert worst_healthy < HEALTHY_BY_S, f"healthy answers took {worst_healthy:.2f}s"
    assert found == [k not in silent for k in keys]
    assert IO_TIMEOUT_S - 0.5 <= took < IO_TIMEOUT_S + MARGIN_S
    assert down, "a node silent past io_timeout_s is marked down"
    wait_until(lambda: client.exists(keys) == [True] * len(keys), 10.0, what="the continued node to answer")


def test_a_connect_to_a_stopped_node_does_not_hold_the_other_nodes_answers(cluster, make_client, wait_until):
    nodes, _, by_node = cluster
    stopped = nodes[0]
    silent = by_node[stopped.address]
    keys = [k for ks in by_node.values() for k in ks]
    healthy = [k for k in keys if k not in silent]
    fresh = make_client(nodes, io_timeout_s=IO_TIMEOUT_S, connect_timeout_s=2.0)  # no pooled connection
    stop(stopped, wait_until)
    try:
        rec = Recorder(keys)
        found = fresh.exists(keys, on_answer=rec)
    finally:
        stopped.signal(signal.SIGCONT)
    assert found == [k not in silent for k in keys]
    worst_healthy = max(rec.answers[k][1] for k in healthy)
    first_silent = min(rec.answers[k][1] for k in silent)
    assert worst_healthy < first_silent and worst_healthy < HEALTHY_BY_S, (worst_healthy, first_silent)
    assert first_silent < 2.0 + MARGIN_S, "the handshake timeout bounds the connect"


def test_exists_timeout_returns_partial_results_and_the_abandoned_connection_is_not_reused(cluster, wait_until):
    nodes, client, by_node = cluster
    stopped = nodes[0]
    silent = by_node[stopped.address]
    keys = [k for ks in by_node.values() for k in ks]
    stop(stopped, wait_until)
    try:
        started = time.monotonic()
        found = client.exists(keys, timeout_s=0.5)
        took = time.monotonic() - started
        up = next(h["up"] for h in client.health() if h["server"] == stopped.address)
    finally:
        stopped.signal(signal.SIGCONT)
    assert found == [k not in silent for k in keys]
    assert 0.4 <= took < IO_TIMEOUT_S, f"exists(timeout_s=0.5) took {took:.2f}s"
    assert up, "the caller's deadline is not a node failure"
    # The node now answers the abandoned request on a closed socket; every later answer must be
    # this call's own (a reused half-read connection would hand over a stale reply or fail).
    for _ in range(5):
        assert client.exists(keys) == [True] * len(keys)
        assert client.exists([*silent, "pipe/never-stored"]) == [True] * len(silent) + [False]


def test_exists_stream_answers_later_rounds_for_healthy_nodes_while_a_stopped_node_owes_the_first(cluster, wait_until):
    nodes, client, by_node = cluster
    stopped = nodes[0]
    silent = set(by_node[stopped.address])
    round1 = [ks[0] for ks in by_node.values()]
    round2 = [ks[1] for ks in by_node.values()]
    rec1, rec2 = Recorder(round1), Recorder(round2)
    stream = client.exists_stream()

    def poll_until(predicate, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for _ in range(10_000):
            if predicate() or time.monotonic() >= deadline:
                break
            stream.poll(min(0.05, max(0.0, deadline - time.monotonic())))
        return bool(predicate())

    try:
        stop(stopped, wait_until)
        try:
            stream.submit([k.encode() for k in round1], rec1)
            assert poll_until(lambda: len(rec1.answers) == 2, HEALTHY_BY_S), rec1.answers
            assert not silent & set(rec1.answers), "the stopped node answered?"
            stream.submit([k.encode() for k in round2], rec2)
            assert poll_until(lambda: len(rec2.answers) == 2, HEALTHY_BY_S), rec2.answers
            assert not silent & (set(rec1.answers) | set(rec2.answers)), "the healthy round waited on the stopped node"
            assert all(hit for hit, _ in rec1.answers.values()) and all(hit for hit, _ in rec2.answers.values())
            assert stream.pending
            assert poll_until(lambda: not stream.pending, IO_TIMEOUT_S + MARGIN_S)
        finally:
            stopped.signal(signal.SIGCONT)
        assert all(rec.answers[k][0] is False for rec in (rec1, rec2) for k in rec.keys if k in silent)
        assert max(rec1.answers[k][1] for k in silent & set(round1)) >= IO_TIMEOUT_S - 0.5
        wait_until(lambda: all(h["up"] for h in client.health()), 5.0, what="the down mark to expire")
        again = Recorder(round1 + round2)
        stream.submit([k.encode() for k in again.keys], again)
        assert poll_until(lambda: not stream.pending, 10.0)
        assert all(hit for hit, _ in again.answers.values()) and len(again.answers) == len(again.keys)
    finally:
        stream.close()


def test_replies_arriving_a_byte_at_a_time_are_assembled_exactly_and_the_connection_is_reused(auth_key_hex):
    def handler(conn: FakeConnection) -> None:
        for _ in range(20):  # bounded: the test sends far fewer requests
            try:
                msg, _ = conn.read_request()
            except OSError:
                return
            statuses = bytes(p.ItemStatus.OK if k.endswith(b"+") else p.ItemStatus.MISS for k in msg.keys)
            frame = conn.codec.encode(p.StatusReply(p.Opcode.EXISTS, statuses), validate=False)
            for i in range(len(frame)):
                conn.sock.sendall(frame[i : i + 1])
                if conn.pause(0.001):
                    return

    with FakeNode(auth_key_hex, handler, limits=p.Limits(max_batch=3)) as fake:

        class _Addr:
            host, port = fake.host, fake.port

        client = build_client([_Addr], auth_key_hex, io_timeout_s=IO_TIMEOUT_S)
        try:
            keys = ["a+", "b", "c+", "d+", "e", "f", "g+"]  # three requests of at most 3 keys
            for _ in range(2):
                rec = Recorder(keys)
                assert client.exists(keys, on_answer=rec) == [k.endswith("+") for k in keys]
                assert sorted(rec.answers) == sorted(keys)
            assert fake.connections == 1, "the connection was not given back in step"
            assert client.health()[0]["up"]
        finally:
            client.close()
    assert not fake.errors, fake.errors
