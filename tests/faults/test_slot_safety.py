"""Slot safety at the client: a load abandoned by its timeout never writes into the buffer later.

Behaviour under test: a node (a fake one speaking the real handshake) sends a GET reply's header,
meta and half of the value, then holds the rest past the client's io_timeout_s and sends it late.
The load reports failure within the timeout; afterwards the caller's buffer does not change
again, not when the late bytes are sent nor after; the timed-out connection is never reused, so
the next load on the same client gets exactly its own value.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.conftest import build_client, poll_until
from tests.faults.fakenode import FakeConnection, FakeNode

pytestmark = pytest.mark.faults

IO_TIMEOUT_S = 0.5
SLACK_S = 1.0


def test_load_abandoned_by_timeout_never_writes_into_the_buffer_afterwards(auth_key_hex, figures):
    late, prompt = os.urandom(1 << 20), os.urandom(1 << 20)
    late_sent = threading.Event()
    outcome: dict = {}
    lock = threading.Lock()
    connections = []

    def handler(conn: FakeConnection) -> None:
        with lock:
            connections.append(conn)
            first = len(connections) == 1
        while True:
            conn.read_request()
            if not first:  # any later connection answers at once
                conn.sock.sendall(conn.get_reply_bytes([prompt]))
                continue
            frame = conn.get_reply_bytes([late])
            head = len(frame) - len(late) // 2  # header, meta, first half of the value
            conn.sock.sendall(frame[:head])
            conn.pause(IO_TIMEOUT_S * 3)  # the client gives up meanwhile
            try:
                conn.sock.sendall(frame[head:])
                outcome["late_send"] = "accepted by the kernel"
            except OSError as exc:
                outcome["late_send"] = f"refused: {type(exc).__name__}"
            outcome["late_sent_at"] = time.monotonic()
            late_sent.set()
            return

    with FakeNode(auth_key_hex, handler) as fake:

        class _Addr:
            host, port = fake.host, fake.port

        client = build_client(
            [_Addr], auth_key_hex, io_timeout_s=IO_TIMEOUT_S, connect_timeout_s=IO_TIMEOUT_S, down_for_s=0.05
        )
        try:
            buf = bytearray(b"\xee" * len(late))
            started = time.monotonic()
            assert client.batch_get_into([("k", buf)]) == [False]
            reported_at = time.monotonic()
            assert reported_at - started < IO_TIMEOUT_S + SLACK_S
            snapshot = bytes(buf)
            assert late_sent.wait(10), "the fake node never sent the late half"
            assert outcome["late_sent_at"] > reported_at
            # Watch the buffer for a while after the late bytes went out: it must not change.
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                assert bytes(buf) == snapshot, "bytes landed in the buffer after the load was reported"
                late_sent.wait(0.02)
            # The timed-out connection was dropped, not pooled: the next load is exact.
            poll_until(lambda: all(n["up"] for n in client.health()), 5.0, what="the down mark to expire")
            other = bytearray(len(prompt))
            assert client.batch_get_into([("k2", other)]) == [True] and other == prompt
        finally:
            client.close()
    assert not fake.errors, fake.errors
    figures(
        abandoned_load_reported_after_s=round(reported_at - started, 3),
        late_bytes=outcome["late_send"],
        buffer_untouched_after_report=True,
    )
