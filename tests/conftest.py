"""Shared fixtures: real `memkv serve` processes on 127.0.0.1 and clients for them.

* `auth_key_hex`: one fresh 64-hex key per test session.
* `start_node(...)`: a factory that starts a real node (`memkv.local.LocalNode`, listening on
  127.0.0.1:0; the node prints its real ports) and stops every node it started when the test
  ends, in `finally`. `start_module_node` is the same factory for module-scoped fixtures.
* `make_client(nodes, ...)`: a factory for `memkv.Client` over a list of nodes, with small
  timeouts suited to tests; every client it built is closed when the test ends.
* `wait_until(predicate, timeout_s)`: the one way tests wait: a deadline-bounded poll.
* `MEMKV_TEST_TOPOLOGY=remote`: every node the factories start runs on another host, a network
  namespace of its own behind a veth pair (tests/netns.py), so that clients reach it as a node of
  another machine: TCP only, no same-host socket, no shared memory. Unset (or "local"): 127.0.0.1.
* `wire`: "plain", or "tls" for the second run of a test marked `over_tls_too` (or of a module
  with `OVER_TLS_TOO = True` whose test starts nodes); the fixtures that start nodes read it.

Nothing here sleeps unbounded or loops without a bound.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest

from memkv import Client, ClientConfig
from memkv.config import AuthKey, ClientTls, ServerAddress
from memkv.local import LocalNode, new_key_hex
from tests.netns import NetnsHost
from tests.tlscerts import node_tls_args, session_pki

DEFAULT_CAPACITY = "256MiB"
TOPOLOGY = os.environ.get("MEMKV_TEST_TOPOLOGY", "") or "local"
if TOPOLOGY not in ("local", "remote"):
    raise RuntimeError(f"MEMKV_TEST_TOPOLOGY={TOPOLOGY!r}: expected 'local' or 'remote'")
REMOTE = TOPOLOGY == "remote"


@pytest.fixture(scope="session")
def auth_key_hex() -> str:
    return new_key_hex()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Over TLS too: a test marked `over_tls_too`, or a test of a module with `OVER_TLS_TOO =
    True` that starts nodes (`start_node`), runs twice, with `wire` "plain" and "tls" (ids end
    in [plain] / [tls], so `-k tls` selects the TLS runs). Fixtures that start nodes read `wire`
    (tests/faults/conftest.py, tests/conformance/conftest.py) and give TLS-only nodes whose
    clients speak TLS."""
    if "wire" not in metafunc.fixturenames:
        return
    marked = metafunc.definition.get_closest_marker("over_tls_too") is not None
    module = getattr(metafunc.module, "OVER_TLS_TOO", False) and "start_node" in metafunc.fixturenames
    if marked or module:
        metafunc.parametrize("wire", ["plain", "tls"])


@pytest.fixture
def wire() -> str:
    """The default when a test runs only once: plain TCP."""
    return "plain"


class NodeFactory:
    """Starts LocalNodes and remembers them so that `stop_all` can stop every one."""

    def __init__(self, auth_key_hex: str, tls: bool = False) -> None:
        self.auth_key_hex = auth_key_hex
        self.nodes: list[LocalNode] = []
        self.hosts: list[NetnsHost] = []  # MEMKV_TEST_TOPOLOGY=remote: one per node
        self.tls = tls  # the default of __call__'s `tls`

    def __call__(
        self,
        capacity: str = DEFAULT_CAPACITY,
        extra_args: Sequence[str] = (),
        auth_key_hex: str | None = None,
        env: dict | None = None,
        preexec_fn: Callable[[], None] | None = None,
        tls: bool | None = None,
    ) -> LocalNode:
        """`tls=True`: a TLS-only data port with the session's test certificate; the node's
        `client_tls` then holds the settings that trust it (build_client, RawSession and
        tests/faults/nodeops.py pick them up)."""
        pki = session_pki() if (self.tls if tls is None else tls) else None
        key = self.auth_key_hex if auth_key_hex is None else auth_key_hex
        args = [*extra_args, *(node_tls_args(pki) if pki else ())]
        if REMOTE:
            host = NetnsHost()
            self.hosts.append(host)
            node = host.start_node(key, capacity=capacity, extra_args=args, env=env, preexec_fn=preexec_fn)
        else:
            node = LocalNode(
                key, capacity=capacity, extra_args=args, ready_timeout_s=30.0, env=env, preexec_fn=preexec_fn
            )
        node.client_tls = ClientTls(ca=pki.ca) if pki else None  # type: ignore[attr-defined]
        self.nodes.append(node)
        return node

    def many(self, count: int, **kwargs) -> list[LocalNode]:
        return [self(**kwargs) for _ in range(count)]

    def stop_all(self) -> None:
        for node in reversed(self.nodes):
            try:
                node.stop(timeout_s=10.0)
            except (OSError, subprocess.TimeoutExpired):  # keep stopping the others
                node.kill()
        for host in self.hosts:
            host.close()
        self.hosts.clear()


def _node_factory(auth_key_hex: str, tls: bool = False) -> Iterator[NodeFactory]:
    factory = NodeFactory(auth_key_hex, tls)
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.fixture
def start_node(auth_key_hex: str) -> Iterator[NodeFactory]:
    yield from _node_factory(auth_key_hex)


@pytest.fixture(scope="module")
def start_module_node(auth_key_hex: str) -> Iterator[NodeFactory]:
    yield from _node_factory(auth_key_hex)


def server_address(node: LocalNode, weight: float = 1.0) -> ServerAddress:
    return ServerAddress(node.host, node.port, weight)


def build_client(
    nodes: Sequence[LocalNode],
    auth_key_hex: str,
    io_timeout_s: float = 2.0,
    connect_timeout_s: float = 1.0,
    down_for_s: float = 0.5,
    **kwargs,
) -> Client:
    if "tls" not in kwargs:  # a TLS node (NodeFactory(tls=True)) is reached over TLS
        kwargs["tls"] = next((n.client_tls for n in nodes if getattr(n, "client_tls", None)), None)
    return Client(
        ClientConfig(
            servers=tuple(server_address(n) for n in nodes),
            auth_key=AuthKey.from_hex(auth_key_hex, "test session key"),
            io_timeout_s=io_timeout_s,
            connect_timeout_s=connect_timeout_s,
            down_for_s=down_for_s,
            **kwargs,
        )
    )


class ClientFactory:
    def __init__(self, auth_key_hex: str) -> None:
        self.auth_key_hex = auth_key_hex
        self.clients: list[Client] = []

    def __call__(self, nodes: Sequence[LocalNode], auth_key_hex: str | None = None, **kwargs) -> Client:
        client = build_client(nodes, self.auth_key_hex if auth_key_hex is None else auth_key_hex, **kwargs)
        self.clients.append(client)
        return client

    def close_all(self) -> None:
        for client in self.clients:
            client.close()


@pytest.fixture
def make_client(auth_key_hex: str) -> Iterator[ClientFactory]:
    factory = ClientFactory(auth_key_hex)
    try:
        yield factory
    finally:
        factory.close_all()


def poll_until(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.02, what: str = "condition"):
    """Call `predicate` until it returns something truthy or `timeout_s` passes; return its
    value or fail the test. The waits between calls are bounded by the deadline."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()  # never set: its wait() is a bounded pause
    while True:
        value = predicate()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        pause.wait(min(interval_s, left))


@pytest.fixture
def wait_until() -> Callable[..., object]:
    return poll_until


@pytest.fixture(scope="session")
def pki():
    """A CA and certificates for TLS tests (tests/tlscerts.py), made once per session."""
    return session_pki()
