"""Helpers for tests that break nodes: admin reads, RSS, stop detection, restart on the same port,
a proxy fault action that SIGKILLs a node, and the client's integrity-failure count.

Every wait here is bounded by a timeout; nothing sleeps bare.
"""

from __future__ import annotations

import json
import os
import re
import threading
import urllib.error
import urllib.request

from memkv.client import metrics as client_metrics
from memkv.local import LocalNode
from tests.tlscerts import admin_context, node_tls_args, session_pki

# For a node behind a FaultProxy (tests/faults/proxy.py): without it, the node names its same-host
# socket in HELLO_OK and the client's later connections would go past the proxy and its faults.
NO_LOCAL_SOCKET = "--no-local-socket"


def admin_get(node: LocalNode, path: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(node.admin_url + path, timeout=timeout_s, context=admin_context(node)) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def status_of(node: LocalNode) -> dict:
    code, body = admin_get(node, "/v1/status")
    assert code == 200, f"/v1/status answered {code}"
    return json.loads(body)


def metrics_of(node: LocalNode) -> str:
    code, body = admin_get(node, "/v1/metrics")
    assert code == 200, f"/v1/metrics answered {code}"
    return body.decode()


def metric_value(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition (0.0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else r"") + r" (\S+)$"
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        # prometheus_client orders labels as declared; our metrics have at most one label
        m = re.match(pattern, line)
        if m:
            return float(m.group(1))
    return 0.0


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def all_threads_stopped(pid: int) -> bool:
    """True once every thread of `pid` is in state T: kill(SIGSTOP) returns before the group
    stop completes, and until then a thread may still answer a request."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:
            continue
    return bool(states) and all(state in ("T", "t") for state in states)


def start_on_port(auth_key_hex: str, port: int, capacity: str = "256MiB", extra_args=(), on=None) -> LocalNode:
    """A fresh, empty node on `port` (its admin port is picked anew), on 127.0.0.1 or on the
    namespace host `on` (tests/netns.py; the host stays the caller's to close)."""
    if on is not None:
        return on.start_node(auth_key_hex, capacity=capacity, extra_args=extra_args, port=port)
    return LocalNode(
        auth_key_hex, capacity=capacity, port=port, extra_args=[*extra_args, "--admin-port", "0"], ready_timeout_s=30.0
    )


def restart_empty(node: LocalNode, capacity: str = "256MiB", extra_args=()) -> LocalNode:
    """SIGKILL `node` and start an empty one on the same port. The caller stops the new one."""
    node.kill()
    return start_again(node, capacity, extra_args)


def start_again(node: LocalNode, capacity: str = "256MiB", extra_args=()) -> LocalNode:
    """An empty node on the port of `node`, which is gone: a TLS node comes back with the same
    certificate (and `client_tls`). The caller stops the new one."""
    tls = getattr(node, "client_tls", None)
    if NO_LOCAL_SOCKET in node.extra_args:  # a node behind a FaultProxy stays behind it
        extra_args = [*extra_args, NO_LOCAL_SOCKET]
    if tls is not None:
        extra_args = [*extra_args, *node_tls_args(session_pki())]
    # On the same host: a node in a network namespace (MEMKV_TEST_TOPOLOGY=remote) comes back there.
    fresh = start_on_port(node.auth_key_hex, node.port, capacity, extra_args, on=getattr(node, "netns_host", None))
    fresh.client_tls = tls  # type: ignore[attr-defined]
    return fresh


def open_fds(pid: int) -> int:
    """Descriptors `pid` has open right now."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def thread_count(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads line")


class NodeKiller:
    """A proxy fault action (`Fault.call(offset, killer)`) that SIGKILLs the node mid-transfer.
    `fired` is set once it did; the test loop restarts the node, sets `node` and clears `fired`."""

    def __init__(self, node: LocalNode) -> None:
        self.node = node
        self.fired = threading.Event()
        self.kills = 0

    def __call__(self) -> None:
        self.kills += 1
        self.node.signal(9)
        self.fired.set()


def integrity_failures() -> float:
    """Values this process's clients loaded whose checksum failed (`memkv_client_integrity_failures`), all servers."""
    return sum(
        s.value for m in client_metrics.INTEGRITY_FAILURES.collect() for s in m.samples if s.name.endswith("_total")
    )
