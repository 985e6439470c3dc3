"""Slot safety under RDMA: no byte reaches a pool slot after its load job was reported.

Behaviour under test, with a node that starts its WRITE after the client gave up (tests/rdma/
late_node.py: a real node whose responder sleeps before posting), driven through the tier's
own TransferPool exactly as memkv_vllm/tier.py's `_load_task` drives it:
* the client reports the load failed within its io timeout and says `may_land_late`;
* the pool withholds the failed job for load_failure_grace_s: the late write lands in the slot
  *before* the job is reported, and the slot does not change after the report;
* a node that honours its window does not write at all once the window closed;
* over TCP a failed load never withholds (the client's own thread received every byte).
UCX tcp cannot show a NIC refusing a write into deregistered memory (docs/rdma.md lists what
only a real NIC can show); these tests rely on the grace period alone, as production must.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from memkv_vllm.transfers import LOAD, TaskResult, TransferPool
from tests.rdma.conftest import requires_nixl, wait_for

pytestmark = pytest.mark.integration

MiB = 1 << 20
IO_TIMEOUT_S = 1.0  # window = 0.5 s
LATE_S = 2.5  # the node posts its write this long after the request
GRACE_S = 4.0  # load_failure_grace_s


def load_task(client, key: str, slot: memoryview):
    """What MemKVSecondaryTierManager._load_task returns for one block."""

    def run() -> TaskResult:
        result = client.batch_load_into([(key, slot)])
        return TaskResult(result.ok, may_land_late=result.may_land_late)

    return run


class SlotWatcher:
    """Records when a slot's first bytes last changed (polls every 2 ms, bounded)."""

    def __init__(self, slot: memoryview) -> None:
        self.slot = slot
        self.changes: list[tuple[float, bytes]] = []
        self._stop = threading.Event()
        self._last = bytes(slot[:64])
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            now = bytes(self.slot[:64]) + bytes(self.slot[-64:])
            if now != self._last:
                self.changes.append((time.monotonic(), now))
                self._last = now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@requires_nixl
def test_a_write_landing_after_the_timeout_is_withheld_until_it_cannot_land(ucx, start_late_node, make_client, pool):
    node = start_late_node(delay_s=LATE_S, ignore_window=True)
    client = make_client([node], transport="rdma", io_timeout_s=IO_TIMEOUT_S)
    assert client.register_pool(pool)
    value = os.urandom(MiB)
    client.put("late/k", value)
    slot = pool[:MiB]
    slot[:] = bytes(MiB)
    watcher = SlotWatcher(slot)
    tpool = TransferPool(1, 1, grace_s=GRACE_S)
    reported_at = None
    try:
        started = time.monotonic()
        tpool.submit(7, LOAD, [b"late/k"], [(0, 1, load_task(client, "late/k", slot))])
        finished = []
        while time.monotonic() - started < LATE_S + GRACE_S + 10 and not finished:
            finished = tpool.take_finished()
            if finished:
                reported_at = time.monotonic()
            time.sleep(0.01)
        assert finished and finished[0].ok == [False], "the failed load was never reported"
        assert watcher.changes, "the late write never landed (the test proves nothing)"
        landed_at = watcher.changes[-1][0]
        assert bytes(slot) == value
        assert landed_at < reported_at, "a byte reached the slot after its job was reported"
        assert reported_at - started >= IO_TIMEOUT_S + GRACE_S - 0.1
        time.sleep(1.0)  # nothing more arrives after the report
        assert watcher.changes[-1][0] == landed_at
    finally:
        watcher.stop()
        tpool.shutdown()


@requires_nixl
def test_a_node_past_its_window_writes_nothing(ucx, start_late_node, make_client, pool):
    node = start_late_node(delay_s=1.5, ignore_window=False)
    client = make_client([node], transport="rdma", io_timeout_s=IO_TIMEOUT_S)
    assert client.register_pool(pool)
    client.put("late/honest", os.urandom(MiB))
    slot = pool[:MiB]
    slot[:] = b"\x5a" * MiB
    t = time.monotonic()
    result = client.batch_load_into([("late/honest", slot)])
    assert result.ok == [False] and result.may_land_late
    assert time.monotonic() - t < IO_TIMEOUT_S + 3.0  # the client gave up in time
    assert not wait_for(lambda: bytes(slot) != b"\x5a" * MiB, 3.0), "a node wrote after its window closed"


def test_tcp_failures_never_withhold(start_node, make_client, pool):
    node = start_node()
    client = make_client([node], transport="tcp")
    result = client.batch_load_into([("absent", pool[:MiB])])
    assert result.ok == [False] and not result.may_land_late
    node.signal(19)  # SIGSTOP: the read times out
    try:
        result = client.batch_load_into([("absent", pool[:MiB])])
        assert result.ok == [False] and not result.may_land_late
    finally:
        node.signal(18)
