"""The socket primitives bound a whole transfer by its deadline, not each syscall.

Behaviour under test (memkv.sockio, on a TCP connection over 127.0.0.1): `recv_exactly_into` with a deadline
raises socket.timeout at the deadline even while the peer keeps trickling bytes (without one, a
trickle keeps it reading); `send_all` with a deadline raises socket.timeout at the deadline while
the peer reads a little at a time; a peer that closes early raises PeerClosed naming how many
bytes came; and with no deadline the primitives behave as before.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from memkv.sockio import (
    PeerClosed,
    recv_exactly,
    recv_exactly_into,
    send_all,
    set_timeouts,
)

pytestmark = pytest.mark.unit

SLACK_S = 0.5


def pair(timeout_s: float = 5.0) -> tuple[socket.socket, socket.socket]:
    """A TCP connection over 127.0.0.1 (AF_UNIX pairs restart their send timeout on every bit
    of progress; TCP, what the node and client use, counts it down within a syscall)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname()[:2], timeout=5)
        b, _ = listener.accept()
    for s in (a, b):
        set_timeouts(s, timeout_s)
    return a, b


def test_recv_with_deadline_gives_up_at_the_deadline_while_bytes_trickle_in():
    a, b = pair(timeout_s=0.5)  # each byte arrives well within the per-syscall timeout
    stop = threading.Event()

    def trickle() -> None:
        for _ in range(100):
            if stop.wait(0.1):
                return
            try:
                b.send(b"x")
            except OSError:
                return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        started = time.monotonic()
        with pytest.raises(socket.timeout):
            recv_exactly_into(a, memoryview(bytearray(1000)), time.monotonic() + 1.0)
        assert time.monotonic() - started < 1.0 + SLACK_S
    finally:
        stop.set()
        t.join(5)
        a.close()
        b.close()


def test_send_with_deadline_gives_up_at_the_deadline_while_the_peer_reads_slowly():
    a, b = pair(timeout_s=0.5)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    stop = threading.Event()

    def read_slowly() -> None:
        for _ in range(1000):
            if stop.wait(0.02):
                return
            try:
                if not b.recv(4096):
                    return
            except OSError:
                return

    t = threading.Thread(target=read_slowly, daemon=True)
    t.start()
    try:
        started = time.monotonic()
        with pytest.raises(socket.timeout):
            send_all(a, [bytes(8 << 20)], time.monotonic() + 1.0)  # would take ~40 s at 200 KiB/s
        assert time.monotonic() - started < 1.0 + SLACK_S
    finally:
        stop.set()
        t.join(5)
        a.close()
        b.close()


def test_peer_closing_early_raises_peer_closed_with_the_count():
    a, b = pair()
    b.sendall(b"abc")
    b.close()
    with pytest.raises(PeerClosed) as info:
        recv_exactly(a, 10, time.monotonic() + 5)
    assert (info.value.got, info.value.total) == (3, 10)
    assert isinstance(info.value, ConnectionError)
    a.close()


def test_without_a_deadline_transfers_complete_as_before():
    a, b = pair()
    payload = bytes(range(256)) * 4096  # 1 MiB
    t = threading.Thread(target=lambda: send_all(b, [b"head", payload]), daemon=True)
    t.start()
    got = recv_exactly(a, 4 + len(payload))
    t.join(5)
    assert bytes(got) == b"head" + payload
    a.close()
    b.close()


# -- TLS: a large transfer runs blocking, bounded by memkv.watchdog ------------------------------


def tls_pair(timeout_s: float = 5.0) -> tuple[socket.socket, socket.socket]:
    """A TLS 1.3 connection over 127.0.0.1 with the test CA's node certificate (a: client)."""
    from memkv.config import ClientTls
    from memkv.tls import client_context, server_context
    from tests.tlscerts import session_pki

    pki = session_pki()
    a, b = pair(timeout_s)
    server = server_context(pki.server.cert, pki.server.key, None)
    done: list[socket.socket] = []
    t = threading.Thread(target=lambda: done.append(server.wrap_socket(b, server_side=True)), daemon=True)
    t.start()
    ta = client_context(ClientTls(ca=pki.ca)).wrap_socket(a, server_hostname="127.0.0.1")
    t.join(5)
    (tb,) = done
    for s in (ta, tb):
        set_timeouts(s, timeout_s)
    return ta, tb


def test_tls_recv_of_a_large_value_gives_up_at_the_deadline_while_records_trickle_in():
    a, b = tls_pair(timeout_s=0.5)  # each record arrives well within the socket timeout
    stop = threading.Event()

    def trickle() -> None:  # 100 one-byte records over 10 s: 2 MiB never arrive whole
        for _ in range(100):
            if stop.wait(0.1):
                return
            try:
                b.send(b"x")
            except OSError:
                return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        with pytest.raises(socket.timeout):
            recv_exactly_into(a, memoryview(bytearray(2 << 20)), time.monotonic() + 1.0)
        assert a.gettimeout() == 0.5  # the blocking mode of the transfer is undone
    finally:
        stop.set()
        t.join(5)
        a.close()
        b.close()


def test_tls_send_of_a_large_value_gives_up_at_the_deadline_while_the_peer_reads_slowly():
    a, b = tls_pair(timeout_s=0.5)
    stop = threading.Event()

    def sip() -> None:  # 4 KiB every 100 ms: 64 MiB would take hours
        for _ in range(100):
            if stop.wait(0.1):
                return
            try:
                b.recv(4096)
            except OSError:
                return

    t = threading.Thread(target=sip, daemon=True)
    t.start()
    try:
        with pytest.raises(socket.timeout):
            send_all(a, [memoryview(bytearray(64 << 20))], time.monotonic() + 1.0)
    finally:
        stop.set()
        t.join(5)
        a.close()
        b.close()


def test_tls_large_values_arrive_whole_within_the_deadline_and_the_connection_stays_usable():
    a, b = tls_pair()
    value = bytes(range(256)) * (12 << 12)  # 12 MiB
    got = bytearray(len(value))
    pieces: list[int] = []
    t = threading.Thread(target=lambda: send_all(b, [b"head", value, b"tail"], time.monotonic() + 20), daemon=True)
    t.start()
    try:
        assert recv_exactly(a, 4, time.monotonic() + 20) == b"head"
        recv_exactly_into(a, memoryview(got), time.monotonic() + 20, lambda piece: pieces.append(len(piece)), 256 << 10)
        assert recv_exactly(a, 4, time.monotonic() + 20) == b"tail"
        t.join(20)
        assert got == value
        assert sum(pieces) == len(value) and all(n >= 256 << 10 for n in pieces[:-1])  # on_piece covers it in order
    finally:
        a.close()
        b.close()
