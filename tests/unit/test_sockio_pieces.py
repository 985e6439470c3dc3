"""The TCP data path's socket primitives on real sockets over 127.0.0.1 (memkv.sockio).

Behaviour under test:
* `recv_exactly_into` with `on_piece` fills the buffer whole and hands every byte to `on_piece`
  exactly once, in order, in pieces of the asked size (the last may be shorter), so a streaming
  hash of the pieces equals the hash of the value;
* with a deadline it gives up at the deadline while a peer trickles bytes, and so does the
  compiled loop (`recv_xxh3_into`) (bounded by the
  deadline plus slack: "did not hang"), and a peer that closes mid-value raises PeerClosed
  naming how many bytes had come;
* `send_all` of a header and many values (more buffers than one sendmsg takes) delivers them
  in order, byte-exact; with a deadline and a peer that does not read, it raises socket.timeout
  (SendTimeout) saying the peer took nothing for nearly all that time, and with a peer that
  reads slowly, that the peer took bytes just before;
* the client picks small receive pieces only while at most two threads receive.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import xxhash

from memkv.sockio import COMPILED_RECEIVE, PeerClosed, SendTimeout, recv_exactly_into, recv_xxh3_into, send_all
from memkv.transport import stream
from tests.unit.loopback import in_thread

KiB, MiB = 1 << 10, 1 << 20
SLACK_S = 3.0  # on top of a deadline, for "did not hang" on a busy 2-core box


def test_pieces_cover_the_value_in_order_and_hash_like_the_whole(pair) -> None:
    a, b = pair
    value = os.urandom(5 * MiB + 123)
    sender = in_thread(lambda: a.sendall(value))
    got = bytearray(len(value))
    pieces: list[int] = []
    hasher = xxhash.xxh3_128()

    def on_piece(piece: memoryview) -> None:
        pieces.append(len(piece))
        hasher.update(piece)

    recv_exactly_into(b, memoryview(got), time.monotonic() + 30, on_piece, 256 * KiB)
    sender.join(10)
    assert got == value
    assert sum(pieces) == len(value)
    assert all(n == 256 * KiB for n in pieces[:-1]) and 0 < pieces[-1] <= 256 * KiB
    assert hasher.digest() == xxhash.xxh3_128_digest(value)


@pytest.mark.parametrize("receive_loop", ["python", "compiled"])
def test_pieces_with_a_deadline_give_up_while_bytes_trickle_in(pair, receive_loop) -> None:
    if receive_loop == "compiled" and not COMPILED_RECEIVE:
        pytest.skip("the compiled loop is not built here")
    a, b = pair
    stop = threading.Event()

    def trickle() -> None:
        for _ in range(2000):  # bounded: 20 s at most
            if stop.is_set():
                return
            try:
                a.send(b"x")
            except OSError:
                return
            time.sleep(0.01)

    sender = in_thread(trickle)
    started = time.monotonic()
    try:
        with pytest.raises(socket.timeout):
            view, deadline = memoryview(bytearray(2 * MiB)), time.monotonic() + 1.0
            if receive_loop == "compiled":
                recv_xxh3_into(b, view, deadline, 256 * KiB)
            else:
                recv_exactly_into(b, view, deadline, lambda piece: None, 256 * KiB)
        assert time.monotonic() - started < 1.0 + SLACK_S
    finally:
        stop.set()
        sender.join(5)


def test_peer_closing_mid_piece_raises_peer_closed_with_the_count(pair) -> None:
    a, b = pair
    a.sendall(bytes(300 * KiB))
    a.close()
    with pytest.raises(PeerClosed) as info:
        recv_exactly_into(b, memoryview(bytearray(1 * MiB)), time.monotonic() + 10, lambda piece: None, 256 * KiB)
    assert (info.value.got, info.value.total) == (300 * KiB, 1 * MiB)


def test_send_all_of_a_header_and_more_values_than_one_sendmsg_takes_arrives_in_order(pair) -> None:
    a, b = pair
    header = b"H" * 92
    pool = memoryview(os.urandom(600 * 64 * KiB))
    values = [pool[i * 64 * KiB : (i + 1) * 64 * KiB] for i in range(600)]  # each its own buffer
    buffers = [header, *values, b"trailer"]
    expected = header + bytes(pool) + b"trailer"
    got = bytearray(len(expected))
    receiver = in_thread(lambda: recv_exactly_into(b, memoryview(got), time.monotonic() + 30))
    send_all(a, buffers, time.monotonic() + 30)
    receiver.join(30)
    assert not receiver.is_alive()
    assert got == expected


def test_send_all_with_a_deadline_gives_up_while_the_peer_does_not_read(pair) -> None:
    a, _b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * KiB)
    started = time.monotonic()
    with pytest.raises(SendTimeout) as raised:
        send_all(a, [b"header", memoryview(bytearray(64 * MiB))], time.monotonic() + 1.0)
    assert time.monotonic() - started < 1.0 + SLACK_S
    assert isinstance(raised.value, socket.timeout)
    # The peer took what the socket buffers hold at once, then nothing: idle nearly all along.
    assert 0 < raised.value.sent < raised.value.total
    assert raised.value.idle_s > 0.5, raised.value


def test_send_all_that_times_out_while_the_peer_reads_slowly_says_the_peer_took_bytes_lately(pair) -> None:
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * KiB)
    stop = threading.Event()

    def read_slowly() -> None:
        for _ in range(400):  # bounded: 400 x 16 KiB every 10 ms, 4 s at most
            if stop.is_set() or not b.recv(16 * KiB):
                return
            time.sleep(0.01)

    reader = in_thread(read_slowly)
    try:
        with pytest.raises(SendTimeout) as raised:
            send_all(a, [b"header", memoryview(bytearray(64 * MiB))], time.monotonic() + 1.0)
    finally:
        stop.set()
        a.close()
        reader.join(10)
    assert 0 < raised.value.sent < raised.value.total
    assert raised.value.idle_s < 0.25, raised.value


def test_small_receive_pieces_only_while_at_most_two_threads_receive() -> None:
    receivers = stream._Receivers()
    with receivers.receiving() as first:
        with receivers.receiving() as second, receivers.receiving() as third:
            steps = [stream._receive_step(False, n) for n in (first, second, third)]
        assert receivers.count == 1
    assert receivers.count == 0
    assert steps == [stream._VERIFY_PIECE, stream._VERIFY_PIECE, stream._VERIFY_CHUNK]
    assert stream._receive_step(True, 1) == stream._TLS_VERIFY_CHUNK  # TLS: records, whatever the count
