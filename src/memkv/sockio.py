"""The two socket primitives of the data path, shared by the node and the client.

Values move between sockets and caller-owned memory with `recv_into` / `sendmsg` on
memoryviews: no intermediate bytes object, no per-value allocation. Both release the GIL for
the whole syscall. These functions raise plain OSError / ConnectionError / socket.timeout;
callers translate them (client: errors.map_os_error; node: close the connection).
"""

from __future__ import annotations

import socket
import struct
from typing import Sequence

# Pieces smaller than this are joined into one send; larger ones go out as they are.
_GATHER_BELOW = 64 << 10


def set_timeouts(sock: socket.socket, recv_s: float, send_s: float | None = None) -> None:
    """Kernel-side timeouts (SO_RCVTIMEO/SO_SNDTIMEO) on a blocking socket.

    Why not `sock.settimeout()`: Python then runs every recv/send as poll() + syscall on a
    non-blocking fd, doubling the syscalls of a 16 MiB transfer, and MSG_WAITALL cannot wait.
    With kernel timeouts the socket stays blocking, `recv_into(..., MSG_WAITALL)` receives a
    whole value in one call, and an expired timeout surfaces as EAGAIN, which the functions
    below turn into socket.timeout.
    """
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(recv_s))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(recv_s if send_s is None else send_s))


def set_recv_timeout(sock: socket.socket, recv_s: float) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(recv_s))


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def recv_exactly_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` completely or raise. A peer that closes early raises ConnectionError; an
    expired kernel timeout raises socket.timeout."""
    got = 0
    total = len(view)
    while got < total:
        try:
            n = sock.recv_into(view[got:], total - got, socket.MSG_WAITALL)
        except BlockingIOError:
            raise socket.timeout(f"timed out after {got} of {total} bytes") from None
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
    try:
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
    except BlockingIOError:
        raise socket.timeout("send timed out") from None


def send_bytes(sock: socket.socket, data: bytes | bytearray | memoryview) -> None:
    send_all(sock, [data])
