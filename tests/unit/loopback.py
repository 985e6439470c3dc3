"""Loopback helpers of the socket-level unit tests (test_sockio_pieces, test_recv_verify)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected (sender, receiver) pair of TCP sockets on 127.0.0.1, closed afterwards."""
    lsock = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lsock.getsockname())
    b, _ = lsock.accept()
    lsock.close()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def in_thread(fn: Callable[[], object]) -> threading.Thread:
    """Run `fn` on a started daemon thread (the peer side of a test)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t
