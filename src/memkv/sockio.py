"""The two socket primitives of the data path, shared by the node and the client.

Values move between sockets and caller-owned memory with `recv_into` / `sendmsg` on
memoryviews: no intermediate bytes object, no per-value allocation. Both release the GIL for
the whole syscall. These functions raise plain OSError / ConnectionError / socket.timeout;
callers translate them (client: errors.map_os_error; node: close the connection).
"""

from __future__ import annotations

import socket
from typing import Sequence

# Pieces smaller than this are joined into one send; larger ones go out as they are.
_GATHER_BELOW = 64 << 10


def recv_exactly_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` completely or raise. A peer that closes early raises ConnectionError."""
    got = 0
    total = len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {total} bytes")
        got += n


def recv_exactly(sock: socket.socket, n: int) -> bytearray:
    """Small reads (headers, meta): a fresh bytearray of exactly n bytes."""
    buf = bytearray(n)
    if n:
        recv_exactly_into(sock, memoryview(buf))
    return buf


def discard(sock: socket.socket, n: int, scratch: memoryview) -> None:
    """Read and drop n bytes (a value the node cannot store) through a reusable scratch buffer."""
    while n > 0:
        chunk = scratch[: min(n, len(scratch))]
        recv_exactly_into(sock, chunk)
        n -= len(chunk)


def send_all(sock: socket.socket, buffers: Sequence[bytes | bytearray | memoryview]) -> None:
    """Send every buffer in order. Small pieces (headers, meta, small values) are joined into
    one syscall; large values are sent from their own memory by `sendall`, which loops in C."""
    small: list[bytes | bytearray | memoryview] = []
    for buf in buffers:
        if len(buf) < _GATHER_BELOW:
            small.append(buf)
            continue
        if small:
            sock.sendall(b"".join(small))
            small = []
        sock.sendall(buf)
    if small:
        sock.sendall(b"".join(small) if len(small) > 1 else small[0])
