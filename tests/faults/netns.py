"""A node in its own network namespace, behind a veth pair that can be cut: a real black hole.

`BlackholeNet` creates a namespace and a veth pair (host side 10.231.N.1, namespace side
10.231.N.2, /30) with `ip`; `start_node()` runs a real `memkv serve` inside it; `cut()` sets the
namespace's end of the link down, so every packet to the node is dropped silently (no RST, no
ICMP: TCP retransmits into the void, exactly like a switch or a host that vanished), and
`heal()` brings it back. `close()` removes everything it created. It needs root and `ip`;
`available()` says whether this machine can (the test skips otherwise).

The node process is started through a tiny wrapper that runs the interpreter under
`ip netns exec`, so `memkv.local.LocalNode` (ready line, ports, stop) is reused unchanged.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from memkv.local import LocalNode


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


class BlackholeNet:
    def __init__(self) -> None:
        n = os.getpid() % 250 + 1
        self.ns = f"memkv-bh-{os.getpid()}"
        self.host_if, self.ns_if = f"mkvh{os.getpid() % 100000}", f"mkvn{os.getpid() % 100000}"
        self.host_ip, self.node_ip = f"10.231.{n}.1", f"10.231.{n}.2"
        self._created: list[str] = []
        self._tmp = tempfile.mkdtemp(prefix="memkv-netns-")
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
        self.python = os.path.join(self._tmp, "python-in-netns")
        with open(self.python, "w") as f:
            f.write(f"#!/bin/sh\nexec ip netns exec {self.ns} {sys.executable} \"$@\"\n")
        os.chmod(self.python, 0o755)

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
            link = _ip("link", "add", f"mkvp{os.getpid() % 100000}", "type", "veth", "peer", "name",
                       f"mkvq{os.getpid() % 100000}", check=False)
            if link.returncode:
                return f"cannot create a veth pair: {link.stderr.strip()}"
            _ip("link", "del", f"mkvp{os.getpid() % 100000}", check=False)
            return None
        finally:
            _ip("netns", "del", probe, check=False)

    def start_node(self, auth_key_hex: str, capacity: str = "64MiB", extra_args=()) -> LocalNode:
        saved = sys.executable
        sys.executable = self.python  # LocalNode runs `sys.executable -m memkv serve ...`
        try:
            return LocalNode(auth_key_hex, capacity=capacity, host=self.node_ip,
                             extra_args=[*extra_args, "--admin-port", "0"], ready_timeout_s=30.0)
        finally:
            sys.executable = saved

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
        if "link" in self._created:
            _ip("link", "del", self.host_if, check=False)
        if "ns" in self._created:
            _ip("netns", "del", self.ns, check=False)
        self._created.clear()
        shutil.rmtree(self._tmp, ignore_errors=True)
