"""The two socket primitives of the data path, shared by the node and the client.

Values move between sockets and caller-owned memory with `recv_into` / `sendmsg` on
memoryviews: no intermediate bytes object, no per-value allocation. Both release the GIL for
the whole syscall. On TCP a frame's header and its values leave in one `sendmsg` (the peer
wakes once); a value is received with MSG_WAITALL whole, or piece by piece when the caller
hashes it (`on_piece`, one receive per piece), or, for an xxh3 value on plain TCP where the
optional compiled loop is built, by `recv_xxh3_into` (pieces hashed in one GIL release). These
functions raise plain OSError / ConnectionError / socket.timeout; callers translate them
(client: errors.map_os_error; node: close the connection).

Deadlines. A kernel timeout bounds one syscall, not a transfer: a peer that trickles a byte
before each timeout expires (or reads a byte at a time) would keep a transfer alive forever.
Pass `deadline` (a `time.monotonic()` instant) to bound the whole transfer: before each syscall
the socket's kernel timeout is cut to the time left, and a transfer still unfinished at the
deadline raises socket.timeout. Costs one setsockopt per syscall; a receive in pieces cuts it
at most every _REARM_S instead (so it may outlive its deadline by that much).

TLS (`ssl.SSLSocket`, memkv/tls.py). Kernel timeouts do not reach through OpenSSL (a read
that times out is retried inside `_ssl`), and an SSLSocket takes no flags (no MSG_WAITALL) and
has no sendmsg. Small transfers (headers, meta, values under _TLS_BLOCKING_BYTES) use Python's
socket timeout, cut to the time left. A large transfer with a deadline runs on the socket in
blocking mode instead, bounded by memkv.watchdog (it shuts the socket down at the deadline): a
timeout makes the socket non-blocking underneath, and every record not yet whole then costs a
failed read, a poll() and two more GIL hand-offs (~6% of a TLS GET, docs/archive/performance-log.md).
Receives land in the caller's memoryview (`SSLSocket.read(n, view)` copies one decrypted TLS
record, up to 16 KiB, into it per call): the loop per record is the hot Python code of a TLS
GET, so it does one read call per record and nothing else (plus, on the timeout path, one
clock read, re-cutting the timeout at most every _REARM_S); `on_piece` lets a caller hash
the value piece by piece inside that same loop. Sends encrypt from the caller's memory into
OpenSSL's record buffer: that is the one copy per byte (the ciphertext has to be written
somewhere), one `sendall` per buffer.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import ssl
import struct
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import cast

from memkv.watchdog import WATCHDOG

try:  # the compiled receive-and-verify loop (csrc/recv_verify.c); optional, see setup.py
    from memkv._recv_verify import recv_xxh3_into as _compiled_recv
except ImportError:  # not built (no compiler, Python < 3.11): the pure-Python loops below
    _compiled_recv = None  # type: ignore[assignment]
# MEMKV_PURE_PYTHON=1 turns the compiled loop off (tests and benchmarks compare the two).
COMPILED_RECEIVE = _compiled_recv is not None and os.environ.get("MEMKV_PURE_PYTHON", "") in ("", "0")

# Pieces smaller than this are joined into one send; larger ones go out as they are.
_GATHER_BELOW = 64 << 10
# Buffers per sendmsg call (Linux's IOV_MAX is 1024).
_IOV_MAX = 512
# A TLS receive takes one record (16 KiB) per call, a TCP receive with `on_piece` one piece;
# cutting the timeout before each would cost a syscall per record or piece (settimeout sets
# O_NONBLOCK again). It is cut at most this often instead, so a transfer may outlive its
# deadline by at most this much.
_REARM_S = 0.05
# TLS transfers from this size on run blocking, bounded by the watchdog (module docstring).
_TLS_BLOCKING_BYTES = 1 << 20
# A send with a deadline blocks at most this long per syscall, so it knows when the peer last
# took bytes: at the deadline, a peer still taking them is told from one that stopped
# (SendTimeout.idle_s). One more syscall per slice of a blocked send costs nothing.
_SEND_SLICE_S = 0.1


def set_timeouts(sock: socket.socket, recv_s: float, send_s: float | None = None) -> None:
    """Kernel-side timeouts (SO_RCVTIMEO/SO_SNDTIMEO) on a blocking socket.

    Why not `sock.settimeout()`: Python then runs every recv/send as poll() + syscall on a
    non-blocking fd, doubling the syscalls of a 16 MiB transfer, and MSG_WAITALL cannot wait.
    With kernel timeouts the socket stays blocking, `recv_into(..., MSG_WAITALL)` receives a
    whole value in one call, and an expired timeout surfaces as EAGAIN, which the functions
    below turn into socket.timeout.
    """
    if isinstance(sock, ssl.SSLSocket):  # see the module docstring, "TLS"
        sock.settimeout(recv_s if send_s is None else min(recv_s, send_s))
        return
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(recv_s))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(recv_s if send_s is None else send_s))


def set_recv_timeout(sock: socket.socket, recv_s: float) -> None:
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(recv_s)
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(recv_s))


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


class PeerClosed(ConnectionError):
    """The peer closed the connection after `got` of the `total` bytes expected."""

    def __init__(self, got: int, total: int) -> None:
        super().__init__(f"peer closed the connection after {got} of {total} bytes")
        self.got = got
        self.total = total


class SendTimeout(TimeoutError):
    """A send still unfinished at its deadline: the peer took `sent` of the `total` bytes, the
    last of them `idle_s` before the deadline (the whole send's time if it took none)."""

    def __init__(self, sent: int, total: int, idle_s: float) -> None:
        super().__init__(f"deadline passed after {sent} of {total} bytes, the last taken {idle_s:.2f}s before")
        self.sent = sent
        self.total = total
        self.idle_s = idle_s


def _arm(sock: socket.socket, option: int, deadline: float, got: int, total: int) -> None:
    """Cut the kernel timeout `option` to the time left before `deadline`, or raise."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"deadline passed after {got} of {total} bytes")
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(max(left, 0.001))
        return
    sock.setsockopt(socket.SOL_SOCKET, option, _timeval(max(left, 0.001)))  # 0 would mean "no timeout"


def recv_exactly_into(
    sock: socket.socket,
    view: memoryview,
    deadline: float | None = None,
    on_piece: Callable[[memoryview], object] | None = None,
    piece_bytes: int = 0,
) -> None:
    """Fill `view` completely or raise. A peer that closes early raises ConnectionError; an
    expired kernel timeout, or `deadline` passing, raises socket.timeout.

    `on_piece(piece)`: called on consecutive pieces of `view`, in order and covering all of it,
    each as soon as it has arrived (at least `piece_bytes` long but the last): a checksum
    hashes the value while it is still in cache. On TLS the pieces are cut inside the loop
    over records; on TCP they are `piece_bytes` each (MSG_WAITALL receives)."""
    if isinstance(sock, ssl.SSLSocket):
        _tls_recv_into(sock, view, deadline, on_piece, piece_bytes)
        return
    if on_piece is None:
        _recv_into(sock, view, deadline)
        return
    _recv_pieces_into(sock, view, deadline, on_piece, piece_bytes or len(view))


def can_recv_xxh3(sock: socket.socket) -> bool:
    """Whether `recv_xxh3_into` can take this socket: the compiled loop is there and on, the
    socket is plain TCP (not TLS) and blocking (kernel timeouts, `set_timeouts`)."""
    return COMPILED_RECEIVE and not isinstance(sock, ssl.SSLSocket) and sock.gettimeout() is None


def recv_xxh3_into(sock: socket.socket, view: memoryview, deadline: float | None, piece_bytes: int) -> bytes:
    """Fill `view` completely and return the xxh3-128 digest of its bytes (16 bytes), or raise
    as recv_exactly_into does. One call of the compiled loop: it receives `piece_bytes` at a time
    and hashes each piece right after, while it is in cache, all without the GIL (no hand-off per
    piece). The timeout is cut to the time left before `deadline` at most every 50 ms, as in
    `_recv_pieces_into`. Only where `can_recv_xxh3(sock)`."""
    assert _compiled_recv is not None
    total = len(view)
    got, err, digest = _compiled_recv(sock.fileno(), view, piece_bytes, -1.0 if deadline is None else deadline)
    if digest is not None:
        return digest
    if err == 0:
        raise PeerClosed(got, total)
    if err == errno.EAGAIN:
        raise TimeoutError(f"timed out after {got} of {total} bytes")
    raise OSError(err, f"{os.strerror(err)} after {got} of {total} bytes")


def _recv_into(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    got = 0
    total = len(view)
    while got < total:
        if deadline is not None:
            _arm(sock, socket.SO_RCVTIMEO, deadline, got, total)
        try:
            n = sock.recv_into(view[got:], total - got, socket.MSG_WAITALL)
        except BlockingIOError:
            raise TimeoutError(f"timed out after {got} of {total} bytes") from None
        if n == 0:
            raise PeerClosed(got, total)
        got += n


def _recv_pieces_into(
    sock: socket.socket,
    view: memoryview,
    deadline: float | None,
    on_piece: Callable[[memoryview], object],
    step: int,
) -> None:
    """recv_exactly_into on TCP with `on_piece`: one MSG_WAITALL receive per piece of `step`
    bytes, then `on_piece` on it (a checksum hashes it while it is in cache). This loop runs
    once per piece (64 times for a 16 MiB value in 256 KiB pieces), so it does little else: the
    kernel timeout is cut to the time left at most every _REARM_S, not before every piece, so a
    transfer may outlive its deadline by at most that much."""
    total = len(view)
    armed = -1.0  # when the timeout was last cut to the time left
    monotonic = time.monotonic
    recv_into = sock.recv_into
    waitall = socket.MSG_WAITALL
    for start in range(0, total, step):
        piece = view[start : start + step]
        if deadline is not None and monotonic() - armed > _REARM_S:  # each receive may block that long
            armed = monotonic()
            _arm(sock, socket.SO_RCVTIMEO, deadline, start, total)
        try:
            n = recv_into(piece, 0, waitall)
        except BlockingIOError:
            raise TimeoutError(f"timed out after {start} of {total} bytes") from None
        if n != len(piece):  # cut short: the timeout expired, a signal came, or the peer closed
            if n == 0:
                raise PeerClosed(start, total)
            try:
                _recv_into(sock, piece[n:], deadline)  # the rest, the timeout cut before each call
            except PeerClosed as exc:
                raise PeerClosed(start + n + exc.got, total) from None
        on_piece(piece)


def _tls_recv_into(
    sock: ssl.SSLSocket,
    view: memoryview,
    deadline: float | None,
    on_piece: Callable[[memoryview], object] | None = None,
    piece_bytes: int = 0,
) -> None:
    """recv_exactly_into on TLS: one record per call, copied into `view` in place."""
    if deadline is not None and len(view) >= _TLS_BLOCKING_BYTES:
        if deadline <= time.monotonic():
            raise TimeoutError(f"deadline passed after 0 of {len(view)} bytes")
        with WATCHDOG.guard(sock, deadline), _blocking(sock):
            _tls_records_into(sock, view, None, on_piece, piece_bytes)
        return
    _tls_records_into(sock, view, deadline, on_piece, piece_bytes)


def _tls_records_into(
    sock: ssl.SSLSocket,
    view: memoryview,
    deadline: float | None,
    on_piece: Callable[[memoryview], object] | None,
    piece_bytes: int,
) -> None:
    got, total = 0, len(view)
    # SSLSocket.read(n, buffer) returns the count: what recv_into calls, minus its argument checks
    # (typeshed types only read(n) -> bytes).
    read = cast(Callable[[int, memoryview], int], sock.read)
    done = 0  # bytes of `view` handed to on_piece
    armed = -1.0  # when the timeout was last cut to the time left
    monotonic = time.monotonic
    while got < total:
        if deadline is not None:
            now = monotonic()
            if now - armed > _REARM_S:  # each call may block for the timeout set at `armed`
                left = deadline - now
                if left <= 0:
                    raise TimeoutError(f"deadline passed after {got} of {total} bytes")
                sock.settimeout(left)
                armed = now
        n = read(total - got, view[got:])
        if n == 0:
            raise PeerClosed(got, total)
        got += n
        if on_piece is not None and got - done >= piece_bytes:
            on_piece(view[done:got])
            done = got
    if on_piece is not None and done < total:
        on_piece(view[done:total])


@contextlib.contextmanager
def _blocking(sock: ssl.SSLSocket) -> Iterator[None]:
    """The block with `sock` in blocking mode (no Python timeout), its timeout restored after."""
    before = sock.gettimeout()
    sock.settimeout(None)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):  # a socket the watchdog cut, or one closed meanwhile
            sock.settimeout(before)


def recv_exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """Small reads (headers, meta): a fresh bytearray of exactly n bytes."""
    buf = bytearray(n)
    if n:
        recv_exactly_into(sock, memoryview(buf), deadline)
    return buf


def recv_exactly_with_fds(sock: socket.socket, n: int, max_fds: int, deadline: float) -> tuple[bytearray, list[int]]:
    """n bytes from an AF_UNIX socket and the descriptors passed with them (SCM_RIGHTS), at most
    `max_fds`. The caller owns (and must close) every descriptor returned; on an error none is
    left open. More descriptors than `max_fds` (the kernel truncates them) raise OSError."""
    buf = bytearray(n)
    view = memoryview(buf)
    fds: list[int] = []
    got = 0
    space = socket.CMSG_SPACE(max_fds * 4)
    try:
        while got < n:
            _arm(sock, socket.SO_RCVTIMEO, deadline, got, n)
            try:
                k, ancdata, flags, _ = sock.recvmsg_into([view[got:]], space)
            except BlockingIOError:
                raise TimeoutError(f"timed out after {got} of {n} bytes") from None
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(int.from_bytes(data[i : i + 4], sys.byteorder) for i in range(0, len(data) - 3, 4))
            if flags & socket.MSG_CTRUNC:
                raise OSError(errno.EMSGSIZE, f"more than {max_fds} descriptors passed")
            if k == 0:
                raise PeerClosed(got, n)
            got += k
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return buf, fds


def discard(sock: socket.socket, n: int, scratch: memoryview, deadline: float | None = None) -> None:
    """Read and drop n bytes (a value the node cannot store) through a reusable scratch buffer."""
    while n > 0:
        chunk = scratch[: min(n, len(scratch))]
        recv_exactly_into(sock, chunk, deadline)
        n -= len(chunk)


def _send_one(sock: socket.socket, buf: bytes | bytearray | memoryview, deadline: float | None) -> None:
    if isinstance(sock, ssl.SSLSocket):
        _tls_send(sock, buf, deadline)
        return
    if deadline is None:
        sock.sendall(buf)  # loops in C
        return
    _sendmsg_all(sock, [memoryview(buf).cast("B")], deadline)


def _tls_send(sock: ssl.SSLSocket, buf: bytes | bytearray | memoryview, deadline: float | None) -> None:
    view = memoryview(buf).cast("B")
    if deadline is not None and len(view) >= _TLS_BLOCKING_BYTES:
        if deadline <= time.monotonic():
            raise TimeoutError(f"deadline passed after 0 of {len(view)} bytes")
        with WATCHDOG.guard(sock, deadline), _blocking(sock):
            sock.sendall(view)  # encrypts from `view`: the one copy
        return
    if deadline is not None:
        _arm(sock, socket.SO_SNDTIMEO, deadline, 0, len(view))  # _ssl bounds the whole SSL_write by it
    sock.sendall(view)


def send_all(
    sock: socket.socket, buffers: Sequence[bytes | bytearray | memoryview], deadline: float | None = None
) -> None:
    """Send every buffer in order. Small pieces (headers, meta, small values) are joined; on TCP
    everything then goes out in one `sendmsg` (a frame's header and its values in one syscall,
    so the peer wakes once), large values from their own memory. TLS has no sendmsg: one
    `sendall` per large value, the small pieces before it joined into one."""
    gathered: list[bytes | bytearray | memoryview] = []
    small: list[bytes | bytearray | memoryview] = []
    for buf in buffers:
        if len(buf) < _GATHER_BELOW:
            small.append(buf)
            continue
        if small:
            gathered.append(b"".join(small) if len(small) > 1 else small[0])
            small = []
        gathered.append(buf)
    if small:
        gathered.append(b"".join(small) if len(small) > 1 else small[0])
    try:
        if isinstance(sock, ssl.SSLSocket) or len(gathered) == 1:
            for buf in gathered:
                _send_one(sock, buf, deadline)
            return
        _sendmsg_all(sock, [memoryview(b).cast("B") for b in gathered], deadline)
    except BlockingIOError:
        raise TimeoutError("send timed out") from None


def _sendmsg_all(sock: socket.socket, views: list[memoryview], deadline: float | None) -> None:
    """All of `views` through sendmsg, at most _IOV_MAX buffers per call. A blocking sendmsg
    queues everything unless its kernel timeout expires, so without a deadline this is one call
    per frame. With one, each call blocks at most _SEND_SLICE_S (then returns what the peer took
    meanwhile), and a send unfinished at the deadline raises SendTimeout saying how long before
    it the peer last took bytes: a busy peer from a stalled one."""
    sent_total, total = 0, sum(map(len, views))
    first = 0  # views[first:] are still (partly) unsent
    took_at = time.monotonic()  # when the peer last took bytes (or the send began)
    while first < len(views):
        if deadline is not None:
            now = time.monotonic()
            if now >= deadline:
                raise SendTimeout(sent_total, total, now - took_at)
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(max(min(deadline - now, _SEND_SLICE_S), 0.001))
            )
            try:
                sent = sock.sendmsg(views[first : first + _IOV_MAX])
            except BlockingIOError:  # the slice passed and the peer took nothing
                continue
            if sent:
                took_at = time.monotonic()
        else:
            sent = sock.sendmsg(views[first : first + _IOV_MAX])
        sent_total += sent
        while first < len(views) and sent >= len(views[first]):
            sent -= len(views[first])
            first += 1
        if sent:
            views[first] = views[first][sent:]
