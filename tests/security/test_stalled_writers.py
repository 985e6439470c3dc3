"""Writers that declare values and stall cannot empty the cache.

Behaviour under test (a 256 MiB node holding 20 values of 12 MiB, 64 MiB values allowed):
* 12 authenticated PUTs, each declaring one 64 MiB value and sending none of its bytes (the
  issue's scenario: it used to evict all 20 values and answer NO_SPACE to everyone else until
  the stalls timed out), evict nothing and reserve nothing: every stored value still reads back
  byte-exact, another client stores and loads a new value at once, and
  `memkv_node_inflight_bytes` stays 0;
* 12 PUTs that send a value's first 128 KiB and then stall may take at most the in-flight bound
  (`max_inflight_bytes`: 2 x the largest value, or a quarter of the capacity when more) from
  the cache, plus one value of rounding: the rest are answered NO_SPACE, counted under
  `memkv_node_puts_refused_total{reason="inflight_limit"}`; other clients' GETs are served
  throughout and their PUTs are answered (NO_SPACE within a second, never a hang); once the
  stalls pass `--io-timeout` the bound is free again and PUTs are stored.

The stalled connections are RawSessions (a real handshake, then a real PUT frame); every wait is
a deadline-bounded poll.
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest

from memkv import protocol as p
from tests.faults.nodeops import metric_value, metrics_of, status_of
from tests.security.raw import RawSession

pytestmark = pytest.mark.integration

MiB = 1 << 20
STORED = 20
VALUE = 12 * MiB
DECLARED = 64 * MiB
STALLED = 12
IO_TIMEOUT_S = 4.0


@pytest.fixture(params=["plain", "tls"])
def full_node(start_node, make_client, request):
    node = start_node(capacity="256MiB", extra_args=["--io-timeout", str(IO_TIMEOUT_S)], tls=request.param == "tls")
    client = make_client([node], io_timeout_s=10.0)
    values = {f"stored/{i}": os.urandom(VALUE) for i in range(STORED)}
    for key, value in values.items():
        client.put(key, value)
    assert status_of(node)["values"] == STORED
    return node, client, values


@contextlib.contextmanager
def stalled_puts(node, key_hex: str, send_bytes: int):
    """STALLED connections, each with a PUT of one DECLARED-byte value of which only
    `send_bytes` are sent; closed on exit."""
    sessions = []
    try:
        for i in range(STALLED):
            raw = RawSession(node, key_hex, timeout_s=10.0)
            sessions.append(raw)
            raw.handshake()
            item = p.PutItem(b"stall/%d" % i, DECLARED, p.ChecksumAlgo.XXH3_128, bytes(p.CHECKSUM_BYTES))
            raw.send(raw.encode(p.PutRequest((item,))) + bytes(send_bytes))
        yield sessions
    finally:
        for raw in sessions:
            raw.close()


def puts_read(node) -> float:
    return metric_value(metrics_of(node), "memkv_node_requests_total", op="put")


def all_back(client, values) -> bool:
    for key, value in values.items():
        buf = bytearray(len(value))
        if client.batch_get_into([(key, buf)]) != [True] or buf != value:
            return False
    return True


def test_puts_that_declare_64mib_and_send_nothing_evict_nothing(
    full_node, auth_key_hex, make_client, wait_until, figures
):
    node, client, values = full_node
    before = status_of(node)
    read_before = puts_read(node)
    with stalled_puts(node, auth_key_hex, send_bytes=0):
        wait_until(
            lambda: puts_read(node) >= read_before + STALLED, 10.0, what="the node to read the stalled PUT frames"
        )
        during = status_of(node)
        assert (during["values"], during["evictions"], during["stored_bytes"]) == (
            STORED,
            before["evictions"],
            before["stored_bytes"],
        )
        assert during["inflight_bytes"] == 0
        assert all_back(client, values), "a stored value was lost to writers that sent nothing"
        other = make_client([node], io_timeout_s=10.0)
        fresh = os.urandom(VALUE)
        started = time.monotonic()
        other.put("other/new", fresh)
        put_s = time.monotonic() - started
        assert other.get("other/new") == fresh
    figures(
        stalled_puts=STALLED,
        declared_mib=DECLARED // MiB,
        stored_values=STORED,
        values_after=during["values"],
        evictions=during["evictions"] - before["evictions"],
        other_put_s=round(put_s, 3),
    )


def test_puts_that_stall_mid_value_take_at_most_the_inflight_bound(
    full_node, auth_key_hex, make_client, wait_until, figures
):
    node, client, values = full_node
    before = status_of(node)
    bound = before["max_inflight_bytes"]
    refused_before = metric_value(metrics_of(node), "memkv_node_puts_refused_total", reason="inflight_limit")
    admitted = max(1, bound // DECLARED)
    with stalled_puts(node, auth_key_hex, send_bytes=128 << 10):
        wait_until(
            lambda: (
                metric_value(metrics_of(node), "memkv_node_puts_refused_total", reason="inflight_limit")
                >= refused_before + STALLED - admitted
            ),
            10.0,
            what="the PUTs over the in-flight bound to be refused",
        )
        during = status_of(node)
        assert during["inflight_bytes"] <= bound
        lost = before["stored_bytes"] - during["stored_bytes"]
        assert lost <= bound + VALUE, f"stalled writers took {lost // MiB} MiB of values (bound {bound // MiB} MiB)"
        assert during["values"] >= STORED - (bound + VALUE) // VALUE
        # Readers are served; a writer is answered, NO_SPACE while the bound is held, not left waiting.
        kept = {k: v for k, v in values.items() if client.exists([k]) == [True]}
        assert len(kept) == during["values"] and all_back(client, kept)
        other = make_client([node], io_timeout_s=10.0)
        started = time.monotonic()
        stored = other.batch_put_views([("other/during", os.urandom(VALUE))])
        answered_s = time.monotonic() - started
        # Answered while the stalls still hold the bound (not once they timed out): no clock needed.
        assert status_of(node)["inflight_bytes"] > 0, "the writer was answered only after the stalls ended"
    # The stalls end at --io-timeout (or when the test closes them): the bound is free again.
    wait_until(
        lambda: status_of(node)["inflight_bytes"] == 0, IO_TIMEOUT_S + 5.0, what="the stalled reservations to end"
    )
    fresh = os.urandom(VALUE)
    other.put("other/after", fresh)
    assert other.get("other/after") == fresh
    figures(
        stalled_puts=STALLED,
        inflight_bound_mib=bound // MiB,
        lost_mib=lost // MiB,
        values_left=during["values"],
        other_put_during_stored=stored == [True],
        other_put_answered_s=round(answered_s, 3),
    )
