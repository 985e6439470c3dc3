"""Load: many concurrent clients over an overcommitted node stay within capacity, lanes and time.

Behaviour under test: 32 clients (one connection each) store and load values of 4 to 64 MiB,
in three lanes (`--lane a:a/:0.5 --lane b:b/:0.25`, the default lane takes the last 0.25), keys
picked in proportion to the lane shares, until every client has stored its part of three times
the node's capacity (each lane's distinct values are 1.5 times its share or more). Claims:

* the node's RSS stays within its capacity plus a fixed overhead (sampled every 50 ms), and its
  allocated bytes never exceed the capacity;
* evictions follow the lane shares: every lane evicts under the load, and once the load is gone a
  single writer cycling through the lanes brings each lane to its share: none over it by more than
  one largest value plus the node's free room, none short by more than the others' overshoot plus
  that room (under load, shares are blurred by PUTs in flight, whose lane is charged only at commit, and
  by values pinned by readers: the figures record how far);
* no load returns a value that was not written: every hit is checked byte for byte against the
  value some writer stored under that key (values are slices of a tagged blob, so the bytes name
  their origin);
* no operation waits past the client's bounds: the slowest put and the slowest get of the run
  are each under what the client documents for one such operation on the path it took (a
  connection opened for it: connect and handshake, and the same-host socket's when the node is
  beside it; then each exchange's request and reply within io_timeout_s each: one exchange over
  a socket; through shared memory, for one value, a store's memfd then its commit, and a load's
  memfd then, for a value the node keeps in private memory, the socket: two). io_timeout_s
  alone bounds each piece, not the operation: on a 2-core VM whose host made fresh pages slowly
  one store took 16.6 s.

Driven by bytes, not by time: every client stores a fixed number of bytes (scaled by
MEMKV_FAULT_SCALE), so the traffic -- and that every lane must evict -- does not depend on how
fast the machine is (a 12 s window on a busy 2-core box once moved too little for lane a to
evict). Bounded by an operation cap per client and a generous wall-clock guard that fails the
test rather than let it run on.
"""

from __future__ import annotations

import os
import random
import threading
import time
import zlib

import pytest

from memkv.client.node import LOCAL_HANDSHAKE_S, handshake_timeout_s
from tests.faults.figures import scaled
from tests.faults.nodeops import rss_bytes, status_of

pytestmark = pytest.mark.faults

MiB = 1 << 20
PAGE = 4096
CAPACITY = 2048 * MiB
SIZES = [4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB]
LANES = {"a/": 0.5, "b/": 0.25, "c/": 0.25}  # c/ falls in the default lane
KEYS_PER_LANE = 60  # ~1.5 GiB of distinct values per lane: 2.2x the capacity in all
CLIENTS = 32
IO_TIMEOUT_S = 10.0
RSS_OVERHEAD = 128 * MiB  # interpreter, 32 connection threads, in-flight metadata
BLOB_BYTES = 192 * MiB
PUT_BYTES_PER_CLIENT = 3 * CAPACITY // CLIENTS  # three times the capacity in all
MAX_OPS_PER_CLIENT = 2000  # far above what the bytes need (~8 puts + ~8 gets per client at scale 1)
GUARD_S = 600.0  # fails the test if the load has not finished by then (it takes ~10-30 s)


def tagged_blob() -> bytes:
    blob = bytearray(os.urandom(BLOB_BYTES))
    for page in range(BLOB_BYTES // PAGE):
        blob[page * PAGE : page * PAGE + 8] = page.to_bytes(8, "big")
    return bytes(blob)


def size_of(key: str) -> int:
    return SIZES[zlib.crc32(key.encode()) % len(SIZES)]


class RssSampler:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self.samples = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
                self.samples += 1
            except (FileNotFoundError, ProcessLookupError):
                return


def test_overcommitted_node_under_32_clients_keeps_capacity_lanes_bytes_and_time(start_node, make_client, figures):
    put_bytes_per_client = scaled(PUT_BYTES_PER_CLIENT)
    node = start_node(capacity=f"{CAPACITY // MiB}MiB", extra_args=["--lane", "a:a/:0.5", "--lane", "b:b/:0.25"])
    blob = tagged_blob()
    view = memoryview(blob)
    keys = [f"{lane}{i}" for lane in LANES for i in range(KEYS_PER_LANE)]
    written: dict[str, set[int]] = {k: set() for k in keys}
    written_lock = threading.Lock()
    clients = [make_client([node], io_timeout_s=IO_TIMEOUT_S, pool_size=1) for _ in range(CLIENTS)]
    clients[0].probe()
    # The path decides the bound of one operation (asserted below): the nodes beside this
    # process (the tests session) or in their own network namespaces (conformance-remote).
    local = bool(clients[0].local_servers())
    exchanges = 2 if clients[0].shared_memory_servers() else 1
    baseline_rss = rss_bytes(node.pid)
    sampler = RssSampler(node.pid)
    stop = threading.Event()
    stats = {"puts": 0, "puts_ok": 0, "gets": 0, "hits": 0, "bad": 0, "errors": 0, "bytes": 0}
    worst = {"put": 0.0, "get": 0.0}
    stats_lock = threading.Lock()
    problems: list[str] = []
    allocated_peak = [0]

    lane_keys = [[k for k in keys if k.startswith(lane)] for lane in LANES]
    lane_weights = list(LANES.values())

    def worker(n: int) -> None:
        client = clients[n]
        rng = random.Random(n)
        buf = bytearray(max(SIZES))
        put_bytes = 0
        for _ in range(MAX_OPS_PER_CLIENT):
            if stop.is_set() or put_bytes >= put_bytes_per_client:
                return
            key = rng.choice(rng.choices(lane_keys, lane_weights)[0])  # lanes in proportion to their shares
            size = size_of(key)
            try:
                if rng.random() < 0.5:
                    off = PAGE * rng.randrange((BLOB_BYTES - size) // PAGE)
                    with written_lock:
                        written[key].add(off)  # before sending: a reader may see it from now on
                    t = time.monotonic()
                    ok = client.batch_put_views([(key, view[off : off + size])])[0]
                    took = time.monotonic() - t
                    put_bytes += size
                    with stats_lock:
                        stats["puts"] += 1
                        stats["puts_ok"] += ok
                        stats["bytes"] += size
                        worst["put"] = max(worst["put"], took)
                else:
                    target = memoryview(buf)[:size]
                    t = time.monotonic()
                    ok = client.batch_get_into([(key, target)])[0]
                    took = time.monotonic() - t
                    good = True
                    if ok:
                        off = int.from_bytes(buf[:8], "big") * PAGE
                        with written_lock:
                            known = off in written[key]
                        good = known and buf[:size] == view[off : off + size]
                    with stats_lock:
                        stats["gets"] += 1
                        stats["hits"] += ok
                        stats["bytes"] += size if ok else 0
                        worst["get"] = max(worst["get"], took)
                        if not good:
                            stats["bad"] += 1
                            problems.append(f"{key}: a hit with bytes no writer stored")
            except Exception as exc:  # reported below: the run must have none
                with stats_lock:
                    stats["errors"] += 1
                    problems.append(f"{key}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(CLIENTS)]
    lane_samples = []
    sampler.thread.start()
    started = time.monotonic()
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):  # watch the node while the load runs
            assert time.monotonic() - started < GUARD_S, f"the load had not stored its bytes after {GUARD_S:.0f}s"
            st = status_of(node)
            allocated_peak[0] = max(allocated_peak[0], st["allocated_bytes"])
            lane_samples.append(st)
            stop.wait(0.25)
    finally:
        stop.set()
        for t in threads:
            t.join(IO_TIMEOUT_S * 3)
        sampler.stop.set()
        sampler.thread.join(5)
    took = time.monotonic() - started
    final = status_of(node)
    hung = [t.name for t in threads if t.is_alive()]

    assert not hung, f"client threads still running after the stop: {hung}"
    assert not problems, problems[:5]
    assert stats["bad"] == 0
    assert stats["hits"] > 0 and stats["puts_ok"] > 0
    peak_rss = max(sampler.peak, rss_bytes(node.pid))
    assert allocated_peak[0] <= CAPACITY
    assert peak_rss <= baseline_rss + CAPACITY + RSS_OVERHEAD, (
        f"RSS peaked at {peak_rss // MiB} MiB: baseline {baseline_rss // MiB} MiB + capacity {CAPACITY // MiB} MiB"
    )
    connect_s = clients[0].config.connect_timeout_s
    opening_s = connect_s + handshake_timeout_s(connect_s, IO_TIMEOUT_S) + (LOCAL_HANDSHAKE_S if local else 0.0)
    op_bound_s = opening_s + exchanges * 2 * IO_TIMEOUT_S
    for op, took_s in worst.items():
        assert took_s < op_bound_s, (
            f"a {op} waited {took_s:.2f}s: the client's bound for one on this path is {op_bound_s:.0f}s "
            f"(same-host socket {local}, {exchanges} exchange(s), io_timeout_s {IO_TIMEOUT_S})"
        )
    lanes = {lane["name"]: lane for lane in final["lanes"]}
    assert final["evictions"] > 0
    for name, lane in lanes.items():
        assert lane["evictions"] > 0, f"lane {name} never evicted under overcommit"
    # Shares under load are blurred by what is in flight (a PUT's lane is charged when it
    # commits, after its room was made) and by values pinned by readers. With the load gone,
    # one writer cycling through the lanes brings every lane to its share, within one value.
    settle = clients[0]
    rng = random.Random(99)
    written_bytes = 0
    for i in range(10_000):
        if written_bytes > CAPACITY * 1.5:
            break
        key = keys[(i % len(LANES)) * KEYS_PER_LANE + rng.randrange(KEYS_PER_LANE)]
        size = size_of(key)
        off = PAGE * rng.randrange((BLOB_BYTES - size) // PAGE)
        assert settle.batch_put_views([(key, view[off : off + size])]) == [True]
        written_bytes += size
    settled = {lane["name"]: lane for lane in status_of(node)["lanes"]}
    # A lane grows past its share only into free room (buffers kept for reuse) or by the one value
    # it is writing; so after settling no lane is over by more than room + one value, and a lane
    # under its share is short by at most the others' overshoot plus the room.
    room = CAPACITY - sum(lane["used_bytes"] for lane in settled.values())
    others = (len(settled) - 1) * max(SIZES)
    for name, lane in settled.items():
        over = lane["used_bytes"] - lane["share_bytes"]
        assert -(room + others) <= over <= room + max(SIZES), (
            f"after settling, lane {name} holds {lane['used_bytes'] // MiB} MiB for a {lane['share_bytes'] // MiB} MiB "
            f"share ({room // MiB} MiB free): "
            + ", ".join(f"{n} {v['used_bytes'] // MiB}/{v['share_bytes'] // MiB}" for n, v in settled.items())
        )
    figures(
        clients=CLIENTS,
        seconds=round(took, 1),
        capacity_mib=CAPACITY // MiB,
        baseline_rss_mib=baseline_rss // MiB,
        peak_rss_mib=peak_rss // MiB,
        peak_allocated_mib=allocated_peak[0] // MiB,
        rss_samples=sampler.samples,
        puts=stats["puts"],
        puts_stored=stats["puts_ok"],
        gets=stats["gets"],
        hits_checked_byte_exact=stats["hits"],
        bad_hits=stats["bad"],
        gib_moved=round(stats["bytes"] / (1 << 30), 1),
        worst_put_s=round(worst["put"], 3),
        worst_get_s=round(worst["get"], 3),
        client_io_timeout_s=IO_TIMEOUT_S,
        client_operation_bound_s=op_bound_s,
        same_host_socket=local,
        exchanges_per_operation=exchanges,
        status_samples=len(lane_samples),
        under_load_worst_lane_deviation_mib=max(
            (
                abs(lane["used_bytes"] - lane["share_bytes"]) // MiB
                for st in lane_samples
                if st["allocated_bytes"] >= 0.9 * CAPACITY
                for lane in st["lanes"]
            ),
            default=None,
        ),
        settled_lanes={
            n: {"share_mib": v["share_bytes"] // MiB, "used_mib": v["used_bytes"] // MiB} for n, v in settled.items()
        },
        settled_room_mib=room // MiB,
        lanes={
            n: {
                "share_mib": lane["share_bytes"] // MiB,
                "used_mib": lane["used_bytes"] // MiB,
                "evictions": lane["evictions"],
            }
            for n, lane in lanes.items()
        },
    )
