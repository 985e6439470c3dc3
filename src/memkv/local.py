"""Start real `memkv serve` processes on loopback: for the embedded default, tests and benchmarks.

A LocalNode is a child process running `python -m memkv serve --listen 127.0.0.1:0 ...`; it
waits (bounded) for the node's ready line and parses the real ports from it.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

READY_RE = re.compile(r"memkv node listening on (\S+):(\d+) \(admin (\S+):(\d+)\)")
TLS_RE = re.compile(r"memkv: TLS on (\S+):(\d+) ")  # printed before READY_RE's line


class LocalNode:
    def __init__(
        self,
        auth_key_hex: str,
        capacity: str = "1GiB",
        host: str = "127.0.0.1",
        port: int = 0,
        extra_args: Sequence[str] = (),
        ready_timeout_s: float = 30.0,
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
        launcher: Sequence[str] = (),
    ) -> None:
        """`preexec_fn` runs in the child before `memkv serve` starts (tests set resource
        limits there, e.g. a low RLIMIT_NOFILE). `launcher`: a command prefix that must exec the
        node in place (e.g. `ip netns exec NS`: a node on another host, tests/netns.py), so that
        `pid` stays the node's own."""
        self.auth_key_hex = auth_key_hex
        self.extra_args = tuple(extra_args)
        cmd = [
            *launcher,
            sys.executable,
            "-m",
            "memkv",
            "serve",
            "--listen",
            f"{host}:{port}",
            "--capacity",
            capacity,
            *extra_args,
        ]
        child_env = {**os.environ, **(env or {}), "MEMKV_AUTH_KEY": auth_key_hex, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env, preexec_fn=preexec_fn
        )
        self.output: list[str] = []
        self.host = host
        self.port = self.admin_port = 0
        self.tls_port: int | None = None  # where TLS is served (the data port when TLS-only)
        deadline = time.monotonic() + ready_timeout_s
        ready = threading.Event()

        def pump() -> None:  # keep reading so the child never blocks on a full pipe
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line)
                t = TLS_RE.search(line)
                if t:
                    self.tls_port = int(t.group(2))
                m = READY_RE.search(line)
                if m and not ready.is_set():
                    self.port, self.admin_port = int(m.group(2)), int(m.group(4))
                    ready.set()
            ready.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        ready.wait(max(0.0, deadline - time.monotonic()))
        if not self.port:
            self.stop()
            raise RuntimeError(f"memkv serve did not become ready:\n{''.join(self.output)[-4000:]}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"{'https' if self.tls_port is not None else 'http'}://{self.host}:{self.admin_port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        """Send `sig`. SIGSTOP returns once the process is stopped (at most 2 s): kill() only
        queues the signal, and a node thread running on another core can still answer a
        request sent right after it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            if sig == signal.SIGSTOP:
                deadline = time.monotonic() + 2.0
                while _process_state(self.proc.pid) not in ("T", "t", None) and time.monotonic() < deadline:
                    time.sleep(0.001)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self._pump.join(timeout_s)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> LocalNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def new_key_hex() -> str:
    return secrets.token_hex(32)


def _process_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (Linux), or None where there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
