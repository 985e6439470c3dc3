"""`memkv.Client` over fake nodes at the socket seam: placement, fan-out, down-marking, misses, lifecycle.

Behaviour under test, with the whole client stack running unchanged above the socket
(tests/unit/fakenet.py answers with the real server side of the protocol; no process, no port):
* placement: every key is stored on its HRW owner over the configured list, and only there;
* fan-out: a batch sends one request per owning node, cut to the node's announced max_batch
  (and, for values, its payload bound), and answers come back in the caller's order;
* down-marking: a node that fails is marked down, its keys answer miss at once without I/O
  until `down_for_s` passes, then it is tried again; other nodes are untouched;
* failure-to-miss: a refused connect or a connection reset mid-request turns into misses
  (False / None) for that node's keys on reads and batch writes; the single-key put raises;
* a value whose checksum fails is a miss, and the connection stays in use;
* lifecycle: UNOPENED until the first call (the constructor connects nothing), OPENED, then
  CLOSED: every public method raises ClientClosed, `close()` is idempotent.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator

import pytest

from memkv import Client, ClientClosed, ClientConfig, ClientState, ConnectError, MemKVError, ReadError, sockio
from memkv import protocol as p
from memkv.client import metrics as client_metrics
from memkv.client.hrw import RendezvousRing
from memkv.config import AuthKey
from memkv.transport import stream
from tests.conftest import poll_until
from tests.unit.fakenet import FakeNetwork, FakeNode

pytestmark = pytest.mark.unit

KEY = os.urandom(32)


@pytest.fixture
def network() -> Iterator[FakeNetwork]:
    net = FakeNetwork(KEY)
    try:
        yield net
    finally:
        net.close()


@pytest.fixture
def make_client(network: FakeNetwork) -> Iterator[Callable[..., Client]]:
    clients: list[Client] = []

    def make(**overrides: object) -> Client:
        settings = {
            "transport": "tcp",
            "io_timeout_s": 5.0,
            "connect_timeout_s": 5.0,
            "down_for_s": 60.0,
            "pool_size": 2,
            **overrides,
        }
        config = ClientConfig(servers=tuple(n.address for n in network), auth_key=AuthKey(KEY, "test"), **settings)
        client = Client(config, connect=network.connect)
        clients.append(client)
        return client

    try:
        yield make
    finally:
        for client in clients:
            client.close()


def three_nodes(network: FakeNetwork, **kwargs: object) -> list[FakeNode]:
    return [network.add("10.0.0.1", 9900 + i, **kwargs) for i in range(3)]  # type: ignore[arg-type]


def keys(n: int, prefix: str = "k") -> list[bytes]:
    return [f"{prefix}/{i:04d}".encode() for i in range(n)]


def owners(nodes: list[FakeNode], ks: list[bytes]) -> list[FakeNode]:
    ring = RendezvousRing([n.address.name for n in nodes])
    return [nodes[i] for i in ring.owners(ks)]


def integrity_failures(server: str) -> float:
    return sum(
        s.value
        for m in client_metrics.INTEGRITY_FAILURES.collect()
        for s in m.samples
        if s.name.endswith("_total") and s.labels.get("server") == server
    )


# -- placement and fan-out -------------------------------------------------------------------------


def test_every_key_is_stored_on_its_hrw_owner_over_the_configured_list_and_nowhere_else(network, make_client) -> None:
    nodes = three_nodes(network)
    client = make_client()
    ks = keys(60)
    assert client.batch_put_views([(k, k * 3) for k in ks]) == [True] * 60
    for k, owner in zip(ks, owners(nodes, ks)):
        assert client.owner(k) == owner.address
        assert [n for n in nodes if k in n.values] == [owner]
    assert all(n.values for n in nodes)  # 60 keys reach every one of three nodes


def test_a_batch_sends_one_request_per_owning_node_and_answers_in_the_callers_order(network, make_client) -> None:
    nodes = three_nodes(network)
    client = make_client()
    ks = keys(30)
    client.batch_put_views([(k, k) for k in ks])
    stored = ks[::2]
    client.delete([k for k in ks if k not in stored])
    bufs = [bytearray(len(k)) for k in ks]

    assert client.batch_get_into(list(zip(ks, bufs))) == [k in stored for k in ks]
    assert client.exists(ks) == [k in stored for k in ks]
    assert [bytes(b) for b, k in zip(bufs, ks) if k in stored] == stored
    for node in nodes:
        mine = tuple(k for k, o in zip(ks, owners(nodes, ks)) if o is node)
        assert node.ops("put") == [mine]
        assert node.ops("get") == [mine]
        assert node.ops("exists") == [mine]


def test_batches_are_cut_to_the_max_batch_each_node_announces(network, make_client) -> None:
    (node,) = [network.add("10.0.0.1", 9900, limits=p.Limits(max_batch=4))]
    client = make_client()
    ks = keys(10)
    client.probe()  # learn the node's limits
    assert client.batch_put_views([(k, b"v") for k in ks]) == [True] * 10
    assert client.exists(ks) == [True] * 10
    assert client.batch_get_into([(k, bytearray(1)) for k in ks]) == [True] * 10
    for op in ("put", "exists", "get"):
        assert [len(r) for r in node.ops(op)] == [4, 4, 2]
        assert sum(node.ops(op), ()) == tuple(ks)


def test_values_are_cut_to_the_nodes_payload_bound(network, make_client) -> None:
    (node,) = [network.add("10.0.0.1", 9900, limits=p.Limits(max_value_bytes=1 << 10, max_payload_bytes=2 << 10))]
    client = make_client()
    client.probe()
    ks = keys(5)
    assert client.batch_put_views([(k, bytes(1 << 10)) for k in ks]) == [True] * 5
    assert [len(r) for r in node.ops("put")] == [2, 2, 1]


# -- failures become misses; the node is marked down ---------------------------------------------------


def test_a_refused_node_answers_miss_for_its_keys_only_and_is_marked_down(network, make_client) -> None:
    nodes = three_nodes(network)
    client = make_client()
    ks = keys(30)
    client.batch_put_views([(k, k) for k in ks])
    dead = nodes[1]
    dead.refuse = True
    for node in nodes:  # pooled connections would hide the refusal: the node "restarted"
        node.reset_on = {"get", "exists", "put", "delete"} if node is dead else set()
    alive = [o is not dead for o in owners(nodes, ks)]

    assert client.batch_get_into([(k, bytearray(len(k))) for k in ks]) == alive
    assert client.exists(ks) == alive
    assert client.batch_put_views([(k, k) for k in ks]) == alive
    dead_key = next(k for k, ok in zip(ks, alive) if not ok)
    assert client.get(dead_key) is None
    with pytest.raises(MemKVError):
        client.put(dead_key, b"v")
    health = {h["server"]: h for h in client.health()}
    assert not health[dead.address.name]["up"] and health[dead.address.name]["failures"] >= 1
    assert all(health[n.address.name]["up"] for n in nodes if n is not dead)


def thirty_stored_then_one_node_resets_gets(network, make_client, down_for_s: float, dead_at: int):
    """Three nodes hold 30 keys; then node `dead_at` resets every GET. (nodes, client, keys, dead)."""
    nodes = three_nodes(network)
    client = make_client(down_for_s=down_for_s)
    ks = keys(30)
    client.batch_put_views([(k, k) for k in ks])
    dead = nodes[dead_at]
    dead.reset_on = {"get"}
    return nodes, client, ks, dead


def test_marking_a_node_down_logs_why_and_for_how_long(network, make_client, caplog) -> None:
    _, client, ks, dead = thirty_stored_then_one_node_resets_gets(network, make_client, 7.0, dead_at=2)
    with caplog.at_level(logging.WARNING, logger="memkv"):
        client.batch_get_into([(k, bytearray(len(k))) for k in ks])
    (line,) = [r.getMessage() for r in caplog.records if "marked down" in r.getMessage()]
    assert dead.address.name in line and "for 7.0s" in line
    reason = line.split("for 7.0s: ", 1)[1]
    assert reason and reason == {h["server"]: h for h in client.health()}[dead.address.name]["last_error"]


def test_a_node_marked_down_is_not_contacted_until_down_for_s_then_tried_again(network, make_client) -> None:
    nodes, client, ks, dead = thirty_stored_then_one_node_resets_gets(network, make_client, 60.0, dead_at=0)
    alive = [o is not dead for o in owners(nodes, ks)]
    assert client.batch_get_into([(k, bytearray(len(k))) for k in ks]) == alive
    seen = (dead.connects, len(dead.requests))
    dead.reset_on = set()  # healthy again, but the client must not know yet

    for _ in range(3):
        assert client.batch_get_into([(k, bytearray(len(k))) for k in ks]) == alive
        assert client.exists(ks) == alive
    assert (dead.connects, len(dead.requests)) == seen  # failed fast: no connect, no request

    retry = make_client(down_for_s=0.05)  # same nodes, a short down time
    dead.reset_on = {"exists"}
    assert retry.exists(ks) == alive
    dead.reset_on = set()
    assert poll_until(lambda: retry.exists(ks) == [True] * 30, timeout_s=5.0)


def test_a_connection_reset_mid_request_fails_that_nodes_keys_and_no_other(network, make_client) -> None:
    nodes = three_nodes(network)
    client = make_client()
    ks = keys(30)
    client.batch_put_views([(k, k) for k in ks])
    nodes[2].reset_on = {"get", "exists", "delete"}
    alive = [o is not nodes[2] for o in owners(nodes, ks)]
    assert client.batch_get_into([(k, bytearray(len(k))) for k in ks]) == alive
    assert client.exists(ks) == alive
    assert client.delete(ks) == alive


def test_the_single_key_put_raises_the_transport_error_naming_the_server(network, make_client) -> None:
    (node,) = [network.add("10.0.0.1", 9900)]
    client = make_client()
    node.refuse = True
    with pytest.raises(ConnectError, match=r"10\.0\.0\.1:9900"):
        client.put(b"k", b"v")
    node.refuse, node.reset_on = False, {"put"}
    fresh = make_client()
    with pytest.raises(ReadError, match=r"10\.0\.0\.1:9900"):
        fresh.put(b"k", b"v")


@pytest.mark.parametrize("receive_loop", ["compiled", "python"])
def test_a_value_that_fails_its_checksum_is_a_miss_and_the_connection_stays_in_use(
    network, make_client, monkeypatch, receive_loop
) -> None:
    if receive_loop == "compiled" and not sockio.COMPILED_RECEIVE:
        pytest.skip("the compiled loop is not built here")
    monkeypatch.setattr(sockio, "COMPILED_RECEIVE", receive_loop == "compiled")
    compiled_calls = []
    real = stream.recv_xxh3_into
    monkeypatch.setattr(stream, "recv_xxh3_into", lambda *a: compiled_calls.append(1) or real(*a))
    (node,) = [network.add("10.0.0.1", 9900)]
    client = make_client()
    client.batch_put_views([(b"a", b"x" * 100), (b"b", b"y" * 100)])
    before = integrity_failures(node.address.name)
    node.corrupt = True
    buf = bytearray(100)
    assert client.batch_get_into([(b"a", buf), (b"b", bytearray(100))]) == [False, False]
    assert integrity_failures(node.address.name) == before + 2
    node.corrupt = False
    connects = node.connects
    assert client.batch_get_into([(b"a", buf)]) == [True] and buf == b"x" * 100
    assert node.connects == connects
    assert client.health()[0]["up"]
    assert bool(compiled_calls) == (receive_loop == "compiled")  # the loop under test is the one that ran


# -- lifecycle ---------------------------------------------------------------------------------------------

PUBLIC_CALLS: list[tuple[str, Callable[[Client], object]]] = [
    ("servers", lambda c: c.servers()),
    ("owner", lambda c: c.owner(b"k")),
    ("has_rdma", lambda c: c.has_rdma()),
    ("register_pool", lambda c: c.register_pool(bytearray(8))),
    ("health", lambda c: c.health()),
    ("put", lambda c: c.put(b"k", b"v")),
    ("get", lambda c: c.get(b"k")),
    ("exists", lambda c: c.exists([b"k"])),
    ("exists_stream", lambda c: c.exists_stream()),
    ("exists_on", lambda c: c.exists_on(c.config.servers[0], [b"k"])),
    ("delete", lambda c: c.delete([b"k"])),
    ("batch_put_views", lambda c: c.batch_put_views([(b"k", b"v")])),
    ("batch_get_into", lambda c: c.batch_get_into([(b"k", bytearray(1))])),
    ("batch_load_into", lambda c: c.batch_load_into([(b"k", bytearray(1))])),
    ("list_keys", lambda c: c.list_keys()),
    ("probe", lambda c: c.probe()),
    ("__enter__", lambda c: c.__enter__()),
]


def test_the_constructor_connects_nothing_and_the_first_call_opens_the_client(network, make_client) -> None:
    (node,) = [network.add("10.0.0.1", 9900)]
    client = make_client()
    assert client.state is ClientState.UNOPENED and node.connects == 0
    assert client.exists([b"k"]) == [False]
    assert client.state is ClientState.OPENED and node.connects == 1


@pytest.mark.parametrize("name,call", PUBLIC_CALLS, ids=[c[0] for c in PUBLIC_CALLS])
def test_every_public_method_of_a_closed_client_raises_client_closed(network, make_client, name, call) -> None:
    network.add("10.0.0.1", 9900)
    client = make_client()
    client.put(b"k", b"v")
    client.close()
    assert client.state is ClientState.CLOSED
    with pytest.raises(ClientClosed, match="closed"):
        call(client)


def test_close_is_idempotent_and_a_with_block_closes(network, make_client) -> None:
    network.add("10.0.0.1", 9900)
    with make_client() as client:
        assert client.state is ClientState.OPENED
        client.put(b"k", b"v")
    assert client.state is ClientState.CLOSED
    client.close()
    assert client.state is ClientState.CLOSED
    unopened = make_client()
    unopened.close()
    with pytest.raises(ClientClosed):
        unopened.get(b"k")


def test_use_after_close_is_not_a_memkv_error_so_a_miss_handler_cannot_hide_it(network, make_client) -> None:
    network.add("10.0.0.1", 9900)
    client = make_client()
    client.close()
    try:
        client.batch_get_into([(b"k", bytearray(1))])
    except MemKVError:  # what the tier turns into a miss
        pytest.fail("use after close was swallowed as a node failure")
    except ClientClosed:
        pass
