"""Same-host nodes over their abstract Unix socket (docs/protocol.md section 2.6).

Behaviour under test, against real `memkv serve` processes on 127.0.0.1:
* by default a client's connections to a node on this host go to the socket the node names in
  HELLO_OK (the node counts them; the client's pooled sockets are AF_UNIX), values round-trip
  byte-exact over it, and the tier-facing `local_servers()` says so;
* `memkv serve --no-local-socket` names none, and MEMKV_LOCAL_SOCKET=off keeps a client on TCP
  even when one is named: nothing then reaches the Unix socket;
* a name that cannot be reached from here (another host or network namespace) costs one
  refused connect, then the client stays on TCP and never tries that name again;
* a name that answers as another node (a HELLO_OK naming someone else's socket) is not
  trusted: the client stays on TCP to the node it asked for, and values come from that node;
* a node restarted on the same port names a new socket, which the client learns and uses (a
  squatter on the old name: tests/security/test_socket_squatting.py);
* a stalled node costs a caller the socket's short deadline plus one TCP handshake timeout, which
  marks it down; once it runs again the client is back on its socket;
* the Unix socket is the data port's protocol: a wrong key is refused there as on TCP, and
  garbage on it never stops the node;
* a TLS node names no same-host socket (TLS was asked for).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
import urllib.request

import pytest

from memkv import protocol as p
from memkv.client.node import NodeConnection, local_connect
from memkv.config import AuthKey, ClientConfig, ServerAddress
from memkv.errors import AuthError, ConfigError
from memkv.local import new_key_hex
from tests.faults.fakenode import FakeNode
from tests.faults.nodeops import restart_empty

pytestmark = pytest.mark.integration

MiB = 1 << 20


def status_of(node) -> dict:
    with urllib.request.urlopen(node.admin_url + "/v1/status", timeout=5) as resp:
        return json.loads(resp.read())


def local_accepted(node) -> float:
    with urllib.request.urlopen(node.admin_url + "/v1/metrics", timeout=5) as resp:
        text = resp.read().decode()
    (line,) = [x for x in text.splitlines() if x.startswith("memkv_node_local_connections_accepted_total ")]
    return float(line.split()[1])


def pooled_families(client) -> list[int]:
    return [conn.sock.family for node in client._nodes for conn in node._idle]


def test_a_client_reaches_a_same_host_node_over_its_unix_socket_byte_exact(start_node, make_client):
    node = start_node(capacity="256MiB")
    name = status_of(node)["local_socket"]
    assert name is not None and name.startswith("@memkv-"), name
    client = make_client([node])
    values = {f"k{i}": os.urandom(size) for i, size in enumerate([1, 4096, 1 * MiB, 16 * MiB])}
    assert client.batch_put_views(list(values.items())) == [True] * len(values)
    for key, value in values.items():
        buf = bytearray(len(value))
        assert client.batch_get_into([(key, buf)]) == [True]
        assert buf == value
    assert client.local_servers() == [f"{node.host}:{node.port}"]
    assert pooled_families(client) and set(pooled_families(client)) == {socket.AF_UNIX}
    # One TCP connection taught the client the name (then closed); every later one came over Unix.
    assert local_accepted(node) >= 1
    assert any(name in line for line in node.output), "memkv serve prints the name it serves"


def test_no_local_socket_on_the_node_or_the_client_keeps_every_connection_on_tcp(start_node, make_client):
    quiet = start_node(capacity="64MiB", extra_args=["--no-local-socket"])
    assert status_of(quiet)["local_socket"] is None
    named = start_node(capacity="64MiB")
    for nodes, kwargs in (([quiet], {}), ([named], {"local_socket": False})):
        client = make_client(nodes, **kwargs)
        assert client.batch_put_views([("k", b"v" * 1000)]) == [True]
        assert client.get("k") == b"v" * 1000
        assert client.local_servers() == []
        assert set(pooled_families(client)) == {socket.AF_INET}
    assert local_accepted(quiet) == 0 and local_accepted(named) == 0


def _ping_forever(conn) -> None:
    while True:
        msg, _ = conn.read_request()
        if isinstance(msg, p.PingRequest):
            conn.reply(p.PingReply())
        elif isinstance(msg, p.ExistsRequest):
            conn.reply(p.StatusReply(p.Opcode.EXISTS, bytes([p.ItemStatus.OK]) * len(msg.keys)))


def _fresh_connections(node_client, count: int) -> list[int]:
    """Open `count` new connections at once (none idle to reuse); their socket families."""
    for conn in node_client._idle:
        conn.close()
    node_client._idle.clear()
    conns = [node_client.borrow() for _ in range(count)]
    families = [c.sock.family for c in conns]
    for c in conns:
        node_client.give_back(c)
    return families


def test_a_name_not_reachable_from_here_means_tcp_at_once(auth_key_hex, make_client):
    # No process listens on this name: what a node on another host (or in another network
    # namespace) names. The connect is refused at once, and the node stays up.
    unreachable = f"@memkv-1-{os.urandom(12).hex()}"
    with FakeNode(auth_key_hex, _ping_forever, local_socket=unreachable) as fake:
        client = make_client([fake], pool_size=4)
        assert client.exists(["a", "b"]) == [True, True]
        node = client._nodes[0]
        assert node._local_refused == {unreachable} and not node.local
        assert _fresh_connections(node, 3) == [socket.AF_INET] * 3
        assert [h["up"] for h in client.health()] == [True], "an unusable name does not mark the node down"


def test_a_name_that_fails_is_tried_once_however_many_connections_follow(auth_key_hex, make_client):
    # Something listens on the name but is no node (it closes every connection at once): one
    # attempt fails its handshake, and no later connection tries the name again.
    name = f"memkv-1-{os.urandom(12).hex()}"
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind("\0" + name)
    squatter.listen(16)
    squatter.settimeout(0.2)
    accepted, done = [], threading.Event()

    def refuse_all() -> None:
        while not done.is_set():
            try:
                conn, _ = squatter.accept()
            except TimeoutError:
                continue
            accepted.append(1)
            conn.close()

    thread = threading.Thread(target=refuse_all, daemon=True)
    thread.start()
    try:
        with FakeNode(auth_key_hex, _ping_forever, local_socket="@" + name) as fake:
            client = make_client([fake], pool_size=4)
            assert client.exists(["a"]) == [True]
            node = client._nodes[0]
            for _ in range(3):
                assert _fresh_connections(node, 3) == [socket.AF_INET] * 3
            assert client.exists(["b"]) == [True]
            assert len(accepted) == 1 and not node.local
            assert fake.connections >= 10, "every connection went to the node over TCP"
    finally:
        done.set()
        thread.join(2.0)
        squatter.close()


def test_a_name_that_answers_as_another_node_is_not_trusted(start_node, auth_key_hex, make_client):
    real = start_node(capacity="64MiB")
    other = status_of(real)["local_socket"]
    with FakeNode(auth_key_hex, _ping_forever, node_id="fake-b", local_socket=other) as fake:
        client = make_client([fake])
        assert client.exists(["x"]) == [True], "the answer came from the node asked (the fake says yes to all)"
        node = client._nodes[0]
        assert not node.local and other in node._local_refused
        assert set(pooled_families(client)) == {socket.AF_INET}
    assert local_accepted(real) == 1, "the one attempt reached the real node, which answered as itself"


def test_a_restarted_node_names_a_new_socket_and_the_client_moves_to_it(start_node, make_client, wait_until):
    node = start_node(capacity="64MiB", extra_args=["--admin-port", "0"])
    client = make_client([node], down_for_s=0.05)
    assert client.batch_put_views([("before", b"1" * 100)]) == [True]
    first = status_of(node)["local_socket"]
    fresh = restart_empty(node, capacity="64MiB")
    start_node.nodes.append(fresh)
    second = status_of(fresh)["local_socket"]
    assert second != first
    # The pooled socket died with the node: a call fails, marks it down briefly, then reconnects.
    wait_until(
        lambda: client.batch_put_views([("after", b"2" * 100)]) == [True], 10.0, what="a store after the restart"
    )
    assert client.get("after") == b"2" * 100
    assert client.get("before") is None, "the restarted node is empty"
    assert client.local_servers() == [f"{fresh.host}:{fresh.port}"]
    assert local_accepted(fresh) >= 1


def test_the_unix_socket_speaks_the_data_port_protocol_wrong_key_and_garbage_included(start_node, make_client):
    node = start_node(capacity="64MiB")
    name = status_of(node)["local_socket"]
    address = ServerAddress(node.host, node.port)
    conn = NodeConnection(address, bytes.fromhex(node.auth_key_hex), 2.0, 2.0, connect=local_connect(name))
    try:
        assert conn.hello.local_socket == name and isinstance(conn.request(p.PingRequest()), p.PingReply)
    finally:
        conn.close()
    with pytest.raises(AuthError, match="auth key"):
        NodeConnection(address, bytes.fromhex(new_key_hex()), 2.0, 2.0, connect=local_connect(name))
    raw = local_connect(name)(address, 2.0)
    try:
        raw.sendall(os.urandom(4096))
        raw.settimeout(5.0)
        with contextlib.suppress(ConnectionResetError):  # closed with our garbage unread
            while raw.recv(4096):  # the node answers a refusal (or nothing) and closes
                pass
    finally:
        raw.close()
    client = make_client([node])
    assert client.batch_put_views([("still", b"up")]) == [True] and client.get("still") == b"up"


def test_a_tls_node_names_no_same_host_socket(start_node, make_client):
    node = start_node(capacity="64MiB", tls=True)
    client = make_client([node])
    assert client.batch_put_views([("k", b"over tls")]) == [True]
    assert client.get("k") == b"over tls"
    assert client.local_servers() == []
    assert [c.hello.local_socket for n in client._nodes for c in n._idle] == [None]


def test_memkv_local_socket_setting_is_parsed_and_a_bad_value_names_the_variable(tmp_path):
    key = new_key_hex()
    base = {"MEMKV_AUTH_KEY": key}
    assert ClientConfig.from_env(base).local_socket is True
    for word, want in (("off", False), ("ON", True), ("0", False), ("true", True)):
        assert ClientConfig.from_env({**base, "MEMKV_LOCAL_SOCKET": word}).local_socket is want
    with pytest.raises(ConfigError, match="MEMKV_LOCAL_SOCKET: expected on or off, got 'sometimes'"):
        ClientConfig.from_env({**base, "MEMKV_LOCAL_SOCKET": "sometimes"})
    yaml_file = tmp_path / "client.yaml"
    yaml_file.write_text(f"auth_key: {key}\nlocal_socket: false\n")
    assert ClientConfig.from_env({"MEMKV_CONFIG": str(yaml_file)}).local_socket is False
    with pytest.raises(ConfigError, match="local_socket"):
        ClientConfig(servers=(ServerAddress("127.0.0.1", 1),), auth_key=AuthKey.from_hex(key, "k"), local_socket="no")


def test_a_stalled_node_costs_the_socket_deadline_and_one_tcp_handshake_and_keeps_its_socket(
    start_node, make_client, wait_until
):
    node = start_node(capacity="64MiB")
    client = make_client([node], io_timeout_s=1.0, connect_timeout_s=0.5, down_for_s=0.2)
    assert client.batch_put_views([("k", b"v" * 100)]) == [True]
    nc = client._nodes[0]
    assert nc.local
    for conn in nc._idle:  # the next call must connect while the node is stopped
        conn.close()
    nc._idle.clear()
    os.kill(node.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert client.get("k") is None, "a stalled node is a miss"
        took = time.monotonic() - started
        assert [h["up"] for h in client.health()] == [False]
    finally:
        os.kill(node.pid, signal.SIGCONT)
    # The socket accepted (the kernel queues it) and its handshake missed the socket's deadline
    # (min(1 s, connect) = 0.5 s); then TCP's handshake timed out too (max(connect, io, 1 s) =
    # 1 s), which marked the node down: the caller is not held much past those two bounds.
    assert took < 0.5 + 1.0 + 1.5, f"the stalled node held the caller {took:.2f} s"
    wait_until(lambda: client.get("k") == b"v" * 100, 10.0, what="a read once the node runs again")
    assert nc.local and not nc._local_refused, "a stall is not a reason to leave the same-host socket"


def test_connections_opened_at_once_by_many_threads_all_reach_the_unix_socket(start_node, make_client):
    """The first connections to a node race: one learns the name over TCP while the others may
    already find it. None may take the name for another node's (each compares node ids)."""
    node = start_node(capacity="64MiB")
    for round_ in range(20):
        client = make_client([node], pool_size=16)
        nc = client._nodes[0]
        start = threading.Barrier(16)
        families: list[int] = []

        def connect_once(i: int, start=start, round_=round_, nc=nc, families=families) -> None:
            start.wait(5.0)
            time.sleep((i * round_ % 7) * 0.0005)  # spread the arrivals over the first handshake
            conn = nc.borrow()
            families.append(conn.sock.family)
            nc.give_back(conn)

        threads = [threading.Thread(target=connect_once, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10.0)
        assert not nc._local_refused, f"a connection refused the node's own socket: {nc._local_refused}"
        assert families == [socket.AF_UNIX] * 16, "every first connection ends on the node's socket"
        client.close()
