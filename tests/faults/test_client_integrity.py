"""Nothing corrupted: under repeated fault injection, a load that reports success has exact bytes.

Behaviour under test: a client stores and loads values of 4 KiB to 1 MiB through a fault-injecting
proxy (tests/faults/proxy.py) in front of a real node, while the proxy flips value, header, MAC
and meta bytes, truncates and resets connections mid-value, stalls replies past the client's
timeout, trickles them (a slow reader as the node sees it), and SIGKILLs the node mid-transfer
(after which it restarts empty on the same port). Claims, over every load of the run:

* every load that reports success (`batch_get_into` -> True) holds, byte for byte, a value the
  client wrote under that key (each value is a slice of a tagged random blob, so the bytes name
  their own origin);
* a flipped value byte is caught by the checksum: the load is a miss, counted in
  `memkv_client_integrity_failures`, and the connection stays usable;
* no call waits past the client's io_timeout_s (plus slack) whatever the fault.

Bounded by a load count and a wall-clock budget, both scaled by MEMKV_FAULT_SCALE. The test runs
twice: plain, and against a TLS-only node with the proxy terminating and re-originating TLS
(`[tls]`: the faults act on the decrypted frames, so TLS itself cannot catch them).
"""

from __future__ import annotations

import random
import threading
import time
import zlib

import pytest

from tests.conftest import build_client, poll_until
from tests.faults.figures import scaled, scaled_s
from tests.faults.nodeops import NO_LOCAL_SOCKET, NodeKiller, integrity_failures, start_again
from tests.faults.proxy import C2S, S2C, Fault, FaultProxy, RandomFaults

pytestmark = pytest.mark.faults
OVER_TLS_TOO = True  # tests/conftest.py: [plain] and [tls]

IO_TIMEOUT_S = 0.5
SLACK_S = 1.5
PAGE = 4096
BLOB_PAGES = 2048  # an 8 MiB blob: every value is a page-aligned slice of it


def tagged_blob(seed: int) -> bytes:
    """Random bytes whose every 4 KiB page starts with its own page number: a slice names its offset."""
    rng = random.Random(seed)
    pages = [i.to_bytes(8, "big") + rng.randbytes(PAGE - 8) for i in range(BLOB_PAGES)]
    return b"".join(pages)


class KillingPlan:
    """RandomFaults, plus a SIGKILL of the node in the middle of a value with probability `kill_rate`."""

    def __init__(self, faults: RandomFaults, killer: NodeKiller, kill_rate: float, max_kills: int, seed: int) -> None:
        self.faults = faults
        self.killer = killer
        self.kill_rate = kill_rate
        self.max_kills = max_kills
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def __call__(self, frame):
        if frame.payload_len and not self.killer.fired.is_set():
            with self.lock:
                if self.killer.kills < self.max_kills and self.rng.random() < self.kill_rate:
                    return Fault.call(frame.payload_start + frame.payload_len // 2, self.killer)
        return self.faults(frame)


def test_loads_under_fault_injection_are_byte_exact_or_a_miss(start_node, auth_key_hex, figures):
    max_loads = scaled(1000)
    budget_s = scaled_s(14.0)
    blob = tagged_blob(7)
    node = start_node(capacity="256MiB", extra_args=["--admin-port", "0", NO_LOCAL_SOCKET])
    port = node.port
    killer = NodeKiller(node)
    faults = RandomFaults(seed=11, rate=0.25, io_timeout_s=IO_TIMEOUT_S, header_rate=0.02)
    plan = KillingPlan(faults, killer, kill_rate=0.01, max_kills=scaled(3), seed=12)
    rng = random.Random(13)
    written: dict[str, set[int]] = {}  # key -> page offsets of every value sent under it
    loads = checked = misses = mismatches = 0
    worst_call_s = 0.0
    restarts = 0
    integrity_before = integrity_failures()

    tls = node.client_tls  # set by start_node: None for a plain node
    with FaultProxy((node.host, port), plan, name="integrity", tls=tls is not None) as proxy:

        class _Addr:
            host, port = proxy.host, proxy.port

        client = build_client(
            [_Addr], auth_key_hex, io_timeout_s=IO_TIMEOUT_S, connect_timeout_s=IO_TIMEOUT_S, down_for_s=0.05, tls=tls
        )
        started = time.monotonic()
        try:
            while loads < max_loads and time.monotonic() - started < budget_s:
                if killer.fired.is_set():  # the node died mid-transfer: bring an empty one back
                    killer.node.proc.wait(10)
                    fresh = start_again(killer.node)
                    start_node.nodes.append(fresh)
                    killer.node = fresh
                    restarts += 1
                    killer.fired.clear()
                # A fault marks the node down for down_for_s (calls fail fast, without I/O): wait
                # for the mark to expire so that every iteration really crosses the proxy.
                poll_until(lambda: all(n["up"] for n in client.health()), 5.0, what="the down mark to expire")
                keys = [f"k/{rng.randrange(64)}" for _ in range(8)]
                sizes = {k: PAGE * (1 + zlib.crc32(k.encode()) % 256) for k in keys}  # fixed per key: 4 KiB..1 MiB
                items = []
                for k in dict.fromkeys(keys):
                    off = PAGE * rng.randrange(BLOB_PAGES - sizes[k] // PAGE)
                    written.setdefault(k, set()).add(off)
                    items.append((k, memoryview(blob)[off : off + sizes[k]]))
                t = time.monotonic()
                client.batch_put_views(items)
                worst_call_s = max(worst_call_s, time.monotonic() - t)

                bufs = [(k, bytearray(sizes[k])) for k in keys]
                t = time.monotonic()
                ok = client.batch_get_into(bufs)
                worst_call_s = max(worst_call_s, time.monotonic() - t)
                for (k, buf), good in zip(bufs, ok):
                    loads += 1
                    if not good:
                        misses += 1
                        continue
                    checked += 1
                    off = int.from_bytes(buf[:8], "big") * PAGE
                    if off not in written[k] or buf != blob[off : off + len(buf)]:
                        mismatches += 1
        finally:
            client.close()
        counts = proxy.counts()
        caught = integrity_failures() - integrity_before
        flips_in_values = sum(
            1 for a in proxy.applied if a.fault.kind == "flip" and a.fault.at >= a.frame.payload_start
        )

    took = time.monotonic() - started
    assert mismatches == 0, f"{mismatches} loads reported success with bytes that were never written"
    assert checked > 0 and misses > 0
    assert worst_call_s < IO_TIMEOUT_S * 2 + SLACK_S, f"a call took {worst_call_s:.2f}s (io_timeout_s {IO_TIMEOUT_S})"
    assert sum(counts.values()) > 0
    if flips_in_values:
        assert caught > 0, "value bytes were flipped but no checksum failure was counted"
    figures(
        client_loads=loads,
        client_loads_checked_byte_exact=checked,
        client_misses=misses,
        client_mismatches=mismatches,
        faults=counts,
        node_kills=killer.kills,
        node_restarts=restarts,
        integrity_failures_caught=int(caught),
        value_flips=flips_in_values,
        worst_call_s=round(worst_call_s, 3),
        seconds=round(took, 1),
        directions=[C2S, S2C],
    )
