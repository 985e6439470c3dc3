"""Fixtures for the RDMA transport tests: NIXL over UCX on loopback, two UCX transports.

The RDMA path runs here without a NIC, the way CI runs it (docs/rdma.md, "Testing"):
* `ucx` is parametrised over `UCX_TLS=tcp` (the WRITE is emulated over TCP; the target's
  progress thread copies) and `UCX_TLS=cma,tcp,self` (the initiator copies with
  process_vm_writev, one-sided like RDMA; UCX's active messages still go over tcp);
* `UCX_NET_DEVICES=lo` keeps UCX on 127.0.0.1;
* `MEMKV_NIXL_PROGRESS_DELAY_US=100` tames NIXL's progress thread (it busy-polls a core per
  agent otherwise, and a client plus three nodes would starve a 2-core machine).
The variables are set before any node starts (nodes inherit them) and before the client builds
its agent. Tests that need NIXL carry `requires_nixl` and skip cleanly without it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from memkv.benchmark import prefaulted_pool
from memkv.local import READY_RE
from memkv.nixl_adapter import INSTALL_HINT, nixl_available, ucx_tls_for_host

HAVE_NIXL, NIXL_WHY = nixl_available()
requires_nixl = pytest.mark.skipif(not HAVE_NIXL, reason=f"NIXL is not installed ({INSTALL_HINT})")

UCX_TRANSPORTS = {"tcp": "tcp", "cma": "cma,tcp,self"}
LATE_NODE = Path(__file__).with_name("late_node.py")


@pytest.fixture(params=sorted(UCX_TRANSPORTS))
def ucx(request, monkeypatch) -> str:
    """UCX on loopback with one of the two CI transports; returns the transport's short name."""
    monkeypatch.setenv("UCX_TLS", ucx_tls_for_host(UCX_TRANSPORTS[request.param]))  # + cuda_copy on a GPU host
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("MEMKV_NIXL_PROGRESS_DELAY_US", "100")
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")
    monkeypatch.delenv("MEMKV_TRANSPORT", raising=False)
    return request.param


@pytest.fixture
def pool():
    """A pre-faulted 64 MiB destination pool (what vLLM's CPU pool is), as a memoryview."""
    mem = prefaulted_pool(64 << 20)
    view = memoryview(mem)
    try:
        yield view
    finally:
        view.release()


class LateNode:
    """tests/rdma/late_node.py as a child process: a real node whose RDMA writes start late."""

    def __init__(
        self,
        auth_key_hex: str,
        delay_s: float,
        ignore_window: bool,
        capacity: str = "256MiB",
        pre_rdma: bool = False,
        on_time: int = 0,
    ) -> None:
        env = {
            **os.environ,
            "MEMKV_AUTH_KEY": auth_key_hex,
            "PYTHONUNBUFFERED": "1",
            "LATE_NODE_DELAY_S": str(delay_s),
            "LATE_NODE_IGNORE_WINDOW": "1" if ignore_window else "0",
            "LATE_NODE_PRE_RDMA": "1" if pre_rdma else "0",
            "LATE_NODE_ON_TIME": str(on_time),
        }
        cmd = [sys.executable, str(LATE_NODE), "serve", "--listen", "127.0.0.1:0", "--capacity", capacity]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.output: list[str] = []
        self.host, self.port = "127.0.0.1", 0
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line)
                found = READY_RE.search(line)
                if found and not ready.is_set():
                    self.port = int(found.group(2))
                    ready.set()
            ready.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        ready.wait(30.0)
        if not self.port:
            self.stop()
            raise RuntimeError(f"late node did not start:\n{''.join(self.output)[-4000:]}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._pump.join(10)


@pytest.fixture
def start_late_node(auth_key_hex):
    nodes: list[LateNode] = []

    def start(delay_s: float = 0.0, ignore_window: bool = False, pre_rdma: bool = False, on_time: int = 0) -> LateNode:
        node = LateNode(auth_key_hex, delay_s, ignore_window, pre_rdma=pre_rdma, on_time=on_time)
        nodes.append(node)
        return node

    try:
        yield start
    finally:
        for node in nodes:
            node.stop()


def node_requests(node, op: str) -> float:
    """memkv_node_requests_total{op=...} from a node's admin metrics."""
    import urllib.request

    with urllib.request.urlopen(f"{node.admin_url}/v1/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(rf'^memkv_node_requests_total{{op="{op}"}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def wait_for(predicate, timeout_s: float, interval_s: float = 0.01):
    """Poll until truthy or the deadline; returns the last value (bounded)."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        pause.wait(interval_s)
