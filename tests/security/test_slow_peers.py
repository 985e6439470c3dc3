"""Slow peers cannot hold a node's connection slots or values past `--io-timeout`.

Behaviour under test: the node bounds the whole handshake, each request frame and each reply
frame by its `--io-timeout` (1 s here), not each read: a client that trickles a hello or a frame
one byte at a time, or reads a 16 MiB GET reply a few KiB at a time (pinning the value), is
disconnected within the timeout plus slack, the connection count returns to its baseline, the
close is counted (`auth_failures{reason="incomplete"}` for a handshake, `errors{code="timeout"}`
for a frame), and the node keeps serving a good client.

Every trickle loop is bounded by a byte count and a wall-clock budget, and each pause is a
bounded wait on an event that never fires.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from memkv import protocol as p
from memkv.local import LocalNode
from tests.faults.nodeops import metric_value, metrics_of, status_of
from tests.security.conftest import IO_TIMEOUT_S
from tests.security.raw import RawSession
from tests.tlscerts import connect_to

pytestmark = pytest.mark.integration

SLACK_S = 1.5  # the node's timer granularity plus scheduling noise on a busy 2-core box
BUDGET_S = IO_TIMEOUT_S * 5 + SLACK_S  # how long a trickle is kept up before the test gives up
_pause = threading.Event()  # never set: wait() is a bounded pause


def trickle(sock: socket.socket, data: bytes, every_s: float, budget_s: float) -> tuple[bool, float]:
    """Send `data` one byte per `every_s` until the peer closes or `budget_s` passes.
    Returns (closed_by_peer, seconds)."""
    started = time.monotonic()
    sock.settimeout(every_s)
    for b in data:
        if time.monotonic() - started > budget_s:
            return False, time.monotonic() - started
        try:
            sock.sendall(bytes([b]))
            if sock.recv(1 << 16) == b"":  # waits up to every_s; the node may answer an error
                return True, time.monotonic() - started
        except TimeoutError:
            continue
        except OSError:
            return True, time.monotonic() - started
    return False, time.monotonic() - started


def still_serves(node: LocalNode, make_client, tag: str) -> None:
    assert node.proc.poll() is None, "the node died"
    client = make_client([node])
    value = os.urandom(4096)
    client.put(f"slow/{tag}", value)
    assert client.get(f"slow/{tag}") == value


def test_hello_trickled_one_byte_at_a_time_is_closed_within_io_timeout(hostile_node, make_client, wait_until, figures):
    baseline = status_of(hostile_node)["connections"]
    before = metric_value(metrics_of(hostile_node), "memkv_node_auth_failures_total", reason="incomplete")
    hello = p.ClientHandshake(os.urandom(32), os.urandom(32)).hello()
    with connect_to(hostile_node, 5.0) as sock:
        closed, took = trickle(sock, hello, every_s=0.3, budget_s=BUDGET_S)
    assert closed, f"a hello trickled at 1 B / 0.3 s kept its connection for {took:.1f}s (io-timeout {IO_TIMEOUT_S}s)"
    assert took < IO_TIMEOUT_S + SLACK_S
    wait_until(lambda: status_of(hostile_node)["connections"] == baseline, 5.0, what="connections back to baseline")
    after = metric_value(metrics_of(hostile_node), "memkv_node_auth_failures_total", reason="incomplete")
    assert after == before + 1
    still_serves(hostile_node, make_client, "hello")
    figures(trickled_hello_closed_after_s=round(took, 3), io_timeout_s=IO_TIMEOUT_S)


def test_frame_trickled_one_byte_at_a_time_is_closed_within_io_timeout(
    hostile_node, auth_key_hex, make_client, wait_until, figures
):
    baseline = status_of(hostile_node)["connections"]
    before = metric_value(metrics_of(hostile_node), "memkv_node_errors_total", code="timeout")
    with RawSession(hostile_node, auth_key_hex) as raw:
        raw.handshake()
        frame = raw.encode(p.ExistsRequest(tuple(b"trickle/%d" % i for i in range(64))))
        closed, took = trickle(raw.sock, frame, every_s=0.3, budget_s=BUDGET_S)
    assert closed, f"a frame trickled at 1 B / 0.3 s kept its connection for {took:.1f}s (io-timeout {IO_TIMEOUT_S}s)"
    assert took < IO_TIMEOUT_S + SLACK_S
    wait_until(lambda: status_of(hostile_node)["connections"] == baseline, 5.0, what="connections back to baseline")
    assert metric_value(metrics_of(hostile_node), "memkv_node_errors_total", code="timeout") == before + 1
    still_serves(hostile_node, make_client, "frame")
    figures(trickled_frame_closed_after_s=round(took, 3), io_timeout_s=IO_TIMEOUT_S)


def test_slow_reader_of_a_16mib_reply_is_dropped_and_its_value_unpinned(
    hostile_node, auth_key_hex, make_client, wait_until, figures
):
    """The node's side is what counts: once it gives up, the bytes already queued in its socket
    buffer still drain to the reader, so the test watches the node's connection count."""
    client = make_client([hostile_node])
    value = os.urandom(16 << 20)
    client.put("slow/pinned", value)
    baseline = status_of(hostile_node)["connections"]
    timeouts_before = metric_value(metrics_of(hostile_node), "memkv_node_errors_total", code="timeout")
    stop = threading.Event()
    received = [0]

    with RawSession(hostile_node, auth_key_hex) as raw:
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.handshake()
        raw.sock.settimeout(1.0)

        def read_slowly() -> None:  # ~40 KiB/s: 16 MiB would take 7 minutes
            while not stop.is_set() and received[0] < len(value):
                try:
                    data = raw.sock.recv(4096)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                received[0] += len(data)
                stop.wait(0.1)

        reader = threading.Thread(target=read_slowly, daemon=True)
        raw.send(raw.encode(p.GetRequest((b"slow/pinned",), (len(value),))))
        started = time.monotonic()
        reader.start()
        try:
            wait_until(
                lambda: status_of(hostile_node)["connections"] == baseline,
                BUDGET_S,
                what="the node to drop the slow reader",
            )
            took = time.monotonic() - started
        finally:
            stop.set()
            reader.join(5.0)
    assert took < IO_TIMEOUT_S + SLACK_S, f"the node kept sending to a slow reader for {took:.1f}s, pinning the value"
    assert received[0] < len(value)
    assert metric_value(metrics_of(hostile_node), "memkv_node_errors_total", code="timeout") == timeouts_before + 1
    # Unpinned: the value can be replaced (its buffer reused) and reads back whole.
    client.put("slow/pinned", value[::-1])
    buf = bytearray(len(value))
    assert client.batch_get_into([("slow/pinned", buf)]) == [True] and buf == value[::-1]
    still_serves(hostile_node, make_client, "reader")
    figures(slow_reader_dropped_after_s=round(took, 3), slow_reader_received_bytes=received[0])
