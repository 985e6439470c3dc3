"""Deadlines for blocking TLS transfers: a thread that shuts a socket down when its deadline passes.

Why: an `ssl.SSLSocket` with a Python timeout is non-blocking underneath, so every record that
has not fully arrived costs a failed read, a poll() and two more GIL hand-offs; with several
transfers per process that is ~6% of a TLS GET's throughput and ~9% more CPU on the 2-vCPU VM
(docs/archive/performance-log.md, "TLS"). Kernel timeouts (SO_RCVTIMEO) do not help: `_ssl` retries a
blocking read that timed out, for ever. So a large TLS transfer runs on a blocking socket, and
this watchdog bounds it instead: `guard(sock, deadline)` registers the socket; if the block is
still running at the deadline, the watchdog calls shutdown(SHUT_RDWR) on the socket's
descriptor, which ends the blocked read (EOF) or write (EPIPE) at once, and the block then
raises TimeoutError. The connection is over either way: whoever sees the error closes it.

Threading: one daemon thread per process (`memkv-deadlines`), started at the first guard. The
heap and every guard's state are owned by `_lock`; the thread fires a guard, shutting its socket
down, only under that lock, and a guard is disarmed under it before `guard` returns, so a socket
is never shut down after its block ended (its descriptor may by then belong to another socket).
A guard costs one lock round and a heap push and pop; the thread wakes only for the earliest
deadline.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import ssl
import threading
import time
from collections.abc import Iterator


class _Guard:
    __slots__ = ("active", "deadline", "fired", "sock")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.active = True
        self.fired = False


class DeadlineWatchdog:
    """See the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, _Guard]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def guard(self, sock: socket.socket, deadline: float) -> Iterator[None]:
        """Run the block with `sock` shut down at `deadline` if it is still running then; a block
        that was cut that way raises TimeoutError (whatever error the cut itself caused)."""
        g = _Guard(sock, deadline)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="memkv-deadlines", daemon=True)
                self._thread.start()
            earliest = not self._heap or deadline < self._heap[0][0]
            heapq.heappush(self._heap, (deadline, next(self._seq), g))
            if earliest:
                self._wake.notify()
        try:
            yield
        except (OSError, ValueError):  # ValueError: ssl's "I/O operation on closed socket"
            if self._disarm(g):
                raise TimeoutError("deadline passed: the transfer was cut") from None
            raise
        if self._disarm(g):
            raise TimeoutError("deadline passed: the transfer was cut")

    def _disarm(self, g: _Guard) -> bool:
        with self._lock:
            g.active = False
            return g.fired

    def _run(self) -> None:
        with self._lock:
            while True:
                while self._heap and not self._heap[0][2].active:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._wake.wait()
                    continue
                wait_s = self._heap[0][0] - time.monotonic()
                if wait_s > 0:
                    self._wake.wait(wait_s)
                    continue
                _, _, g = heapq.heappop(self._heap)
                g.active, g.fired = False, True
                _shutdown(g.sock)


def _shutdown(sock: socket.socket) -> None:
    """shutdown(SHUT_RDWR) of the descriptor; on an SSLSocket without dropping its SSL state
    (SSLSocket.shutdown would, under a thread still inside SSL_read)."""
    try:
        if isinstance(sock, ssl.SSLSocket):
            super(ssl.SSLSocket, sock).shutdown(socket.SHUT_RDWR)
        else:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed or not connected: nothing left to cut
        pass


WATCHDOG = DeadlineWatchdog()

__all__ = ["WATCHDOG", "DeadlineWatchdog"]
