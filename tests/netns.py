"""Other hosts on this machine: network namespaces reached over veth pairs that can be cut.

A `NetnsHost` is a network namespace with its own loopback and a veth pair to the test process's
namespace: host side 10.231.X.(4i+1), namespace side 10.231.X.(4i+2), a /30 per host (X from the
test process's pid, i an index per process that a closed host gives back, so parallel runs and
several hosts per run never collide). A node started there with `start_node()` shares nothing
with the test's clients but the veth link: no abstract Unix socket (those are per network namespace), no shared memory, no
127.0.0.1, exactly what a client on another host gets. `cut()` sets the namespace's end of the
link down, so every packet to the node is dropped silently (no RST, no ICMP: TCP retransmits into
the void, as for a switch or a host that vanished), and `heal()` brings it back. `close()`
removes everything it created. It needs root and `ip`; `available()` says whether this machine
can (tests skip otherwise).

The node runs under `ip netns exec` (which execs, so its pid is the node's own: SIGSTOP and kill
reach it), through `memkv.local.LocalNode`'s launcher prefix: ready line, ports and stop as for a
node on loopback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence

from memkv.local import LocalNode

MAX_HOSTS = 63  # /30s in one 10.231.X.0/24: hosts alive at once in one test process
_FREE = set(range(MAX_HOSTS))  # the i of 10.231.X.(4i+1) not in use; a closed host gives its i back
_FREE_LOCK = threading.Lock()


def _address(index: int, side: int) -> str:
    """Host `index`'s address: side 1 the test's end of its veth pair, side 2 the node's."""
    return f"10.231.{os.getpid() % 250 + 1}.{4 * index + side}"


def node_addresses() -> list[str]:
    """Every address a node of this process can have (the test certificates name them all)."""
    return [_address(index, 2) for index in range(MAX_HOSTS)]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


class NetnsHost:
    def __init__(self) -> None:
        with _FREE_LOCK:
            if not _FREE:
                raise RuntimeError(f"more than {MAX_HOSTS} namespace hosts alive at once in one test process")
            index = min(_FREE)
            _FREE.discard(index)
        self.index: int | None = index
        pid = os.getpid()
        self.ns = f"memkv-h{pid}-{index}"
        tag = f"{pid % 100000}{chr(ord('a') + index % 26)}{index // 26}"  # interface names: 15 chars at most
        self.host_if, self.ns_if = f"mkh{tag}", f"mkn{tag}"
        self.host_ip, self.node_ip = _address(index, 1), _address(index, 2)
        self._created: list[str] = []
        try:
            _ip("netns", "add", self.ns)
            self._created.append("ns")
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            self._created.append("link")
            _ip("link", "set", self.ns_if, "netns", self.ns)
            _ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("netns", "exec", self.ns, "ip", "addr", "add", f"{self.node_ip}/30", "dev", self.ns_if)
            _ip("netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "up")
            _ip("netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def available() -> str | None:
        """None if namespaces and veth pairs can be made here, else why not."""
        if os.geteuid() != 0:
            return "needs root"
        if not shutil.which("ip"):
            return "needs iproute2 (`ip`)"
        probe = f"memkv-probe-{os.getpid()}"
        try:
            made = _ip("netns", "add", probe, check=False)
            if made.returncode:
                return f"cannot create a network namespace: {made.stderr.strip()}"
            link = _ip(
                "link",
                "add",
                f"mkvp{os.getpid() % 100000}",
                "type",
                "veth",
                "peer",
                "name",
                f"mkvq{os.getpid() % 100000}",
                check=False,
            )
            if link.returncode:
                return f"cannot create a veth pair: {link.stderr.strip()}"
            _ip("link", "del", f"mkvp{os.getpid() % 100000}", check=False)
            return None
        finally:
            _ip("netns", "del", probe, check=False)

    @property
    def launcher(self) -> tuple[str, ...]:
        """The command prefix that runs a program on this host."""
        return ("ip", "netns", "exec", self.ns)

    def start_node(
        self, auth_key_hex: str, capacity: str = "64MiB", extra_args: Sequence[str] = (), **kwargs
    ) -> LocalNode:
        """A real `memkv serve` on this host, listening on its veth address (admin port too)."""
        node = LocalNode(
            auth_key_hex,
            capacity=capacity,
            host=self.node_ip,
            extra_args=[*extra_args, "--admin-port", "0"],
            ready_timeout_s=30.0,
            launcher=self.launcher,
            **kwargs,
        )
        node.netns_host = self  # type: ignore[attr-defined]
        return node

    def cut(self) -> None:
        _ip("netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "down")

    def heal(self, timeout_s: float = 10.0) -> None:
        """Bring the link back and return once the host side has its carrier again: the kernel
        applies carrier changes up to a second late (linkwatch), and a connect meanwhile fails
        with "No route to host". Bounded by `timeout_s`; neighbour entries that failed during
        the cut are flushed so the next packet resolves afresh."""
        _ip("netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "up")
        pause = threading.Event()  # never set: wait() is a bounded pause
        deadline = time.monotonic() + timeout_s
        path = f"/sys/class/net/{self.host_if}/operstate"
        while True:
            with open(path) as f:
                if f.read().strip() == "up":
                    break
            if time.monotonic() >= deadline:
                raise AssertionError(f"{self.host_if} still not up {timeout_s}s after heal()")
            pause.wait(0.02)
        _ip("neigh", "flush", "dev", self.host_if, check=False)

    def close(self) -> None:
        """Idempotent; the address pair is free for another host once its link and namespace are gone."""
        if "link" in self._created:
            _ip("link", "del", self.host_if, check=False)
        if "ns" in self._created:
            _ip("netns", "del", self.ns, check=False)
        self._created.clear()
        if self.index is not None:
            with _FREE_LOCK:
                _FREE.add(self.index)
            self.index = None
