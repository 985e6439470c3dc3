"""Fixtures for the conformance suite: real `memkv serve` nodes and the tier's environment.

The suite needs vLLM (a nox `conformance-<release>` session installs it); without it every
test here is skipped, so the plain test run stays fast.

Over TLS: a test marked `over_tls_too` runs a second time (id `[tls]`, tests/conftest.py's
`wire`) against TLS-only nodes (`memkv serve --tls-cert/--tls-key`, the test CA of
tests/tlscerts.py), and `point_at` configures the tier as a user would: MEMKV_TLS_CA. The
tier's code is the same in both runs; only the environment differs.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import queue
import select
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import ClassVar

import pytest

from memkv.local import LocalNode, new_key_hex
from tests.conftest import NodeFactory

try:
    import vllm.v1.kv_offload.tiering.factory  # noqa: F401
except ImportError:  # the plain test run: skip this folder instead of failing to import it
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def auth_key_hex() -> str:
    return new_key_hex()


@contextlib.contextmanager
def start_nodes(auth_key_hex: str, count: int, capacity: str, tls: bool) -> Iterator[list[LocalNode]]:
    """`count` nodes, TLS-only when `tls`, all stopped when the block ends."""
    factory = NodeFactory(auth_key_hex, tls=tls)
    try:
        yield factory.many(count, capacity=capacity)
    finally:
        factory.stop_all()


@pytest.fixture(scope="module")
def cluster(auth_key_hex):
    """Three nodes shared by a module's tests (each test uses its own random keys)."""
    with start_nodes(auth_key_hex, 3, "256MiB", tls=False) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def tls_cluster(auth_key_hex):
    """Three TLS-only nodes shared by a module's `[tls]` tests (started only if one runs)."""
    with start_nodes(auth_key_hex, 3, "256MiB", tls=True) as nodes:
        yield nodes


@pytest.fixture
def private_cluster(auth_key_hex, wire):
    """Two nodes for one test that kills, stops or fills them (TLS-only when wire is "tls")."""
    with start_nodes(auth_key_hex, 2, "256MiB", tls=wire == "tls") as nodes:
        yield nodes


_TLS_VARS = ("MEMKV_TLS_CA", "MEMKV_TLS_CERT", "MEMKV_TLS_KEY", "MEMKV_TLS_SERVER_NAME")


def point_at(monkeypatch, nodes, key_hex: str) -> None:
    """Configure the tier's client (it reads the MEMKV_* environment) for these nodes; TLS
    nodes (NodeFactory's `client_tls`) through MEMKV_TLS_CA, as docs/operations.md tells a user."""
    monkeypatch.setenv("MEMKV_SERVERS", ",".join(n.address for n in nodes))
    monkeypatch.setenv("MEMKV_AUTH_KEY", key_hex)
    for var in ("MEMKV_CONFIG", "MEMKV_LICENSE", "MEMKV_TRANSPORT", *_TLS_VARS):
        monkeypatch.delenv(var, raising=False)
    tls = next((n.client_tls for n in nodes if getattr(n, "client_tls", None) is not None), None)
    if tls is not None:
        monkeypatch.setenv("MEMKV_TLS_CA", tls.ca)
    if os.environ.get("MEMKV_TEST_TRANSPORT"):  # the whole suite over another transport (docs/rdma.md)
        monkeypatch.setenv("MEMKV_TRANSPORT", os.environ["MEMKV_TEST_TRANSPORT"])


@pytest.fixture
def memkv_env(request, monkeypatch, auth_key_hex, wire):
    """The module's shared nodes (TLS ones for a `[tls]` run), the tier pointed at them."""
    import memkv_vllm

    nodes = request.getfixturevalue("tls_cluster" if wire == "tls" else "cluster")
    point_at(monkeypatch, nodes, auth_key_hex)
    memkv_vllm.register()
    return nodes


@pytest.fixture
def no_leaked_regions():
    """Releases up to 0.27 leak the /dev/shm region when a tier constructor raises
    (docs/vllm-api.md section 8); remove what a failing construction left behind."""
    before = set(glob.glob("/dev/shm/vllm_offload_*"))
    yield
    for path in set(glob.glob("/dev/shm/vllm_offload_*")) - before:
        os.unlink(path)


class PluginLog(logging.Handler):
    """Collects memkv_vllm's log lines, tier and direct mode (vLLM's loggers do not propagate to
    pytest's caplog on every release)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.logger = logging.getLogger("vllm.memkv_vllm")

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> PluginLog:
        self._level = self.logger.level
        self.logger.addHandler(self)
        self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self._level)


class WaitingCalls:
    """Records the waiting calls this thread makes while entered: sleeps, waits on events and
    conditions, joins, queue gets, select/poll and socket receives. A profile hook of the thread
    itself (sys.setprofile) sees every call, so the record is exact, not a timing."""

    _PY: ClassVar[dict] = {
        threading.Event.wait.__code__: "Event.wait",
        threading.Condition.wait.__code__: "Condition.wait",
        threading.Thread.join.__code__: "Thread.join",
        queue.Queue.get.__code__: "Queue.get",
    }
    _C_OWNERS = (select.epoll, type(select.poll()), socket.socket)

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _hook(self, frame, event, arg) -> None:
        if event == "call" and frame.f_code in self._PY:
            self.calls.append(self._PY[frame.f_code])
        elif event == "c_call":
            name = getattr(arg, "__name__", "")
            owner = getattr(arg, "__self__", None)
            if (
                arg is time.sleep
                or getattr(arg, "__module__", None) == "select"
                or (isinstance(owner, self._C_OWNERS) and name in ("poll", "recv", "recv_into", "recvfrom", "accept"))
            ):
                where = getattr(arg, "__module__", None) if owner is None or isinstance(owner, type(sys)) else None
                self.calls.append(f"{where or type(owner).__name__}.{name}")
            elif isinstance(owner, queue.SimpleQueue) and name == "get":
                self.calls.append("SimpleQueue.get")

    def __enter__(self) -> WaitingCalls:
        self._before = sys.getprofile()
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self._before)
