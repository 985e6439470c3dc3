"""The staging slot table's quarantine rule and the direct-mode keys, as plain logic.

A slot is handed out again only when its owner released it *and* no transfer can still touch
it; released-while-busy is "quarantined". (In tests/conformance because importing
memkv_vllm.direct imports vLLM.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from memkv.errors import ConfigError
from memkv_vllm.direct.config import DirectSettings
from memkv_vllm.direct.staging import SlotTable

pytestmark = pytest.mark.conformance


def test_a_released_slot_whose_transfer_is_running_is_quarantined_until_the_transfer_ends():
    t = SlotTable(2)
    a, b = t.take(2)
    assert t.take(1) is None and t.free == 0
    t.mark_busy(a)
    t.release(a)  # abandoned by a deadline while its transfer runs
    assert t.quarantined == 1 and t.free == 0 and t.take(1) is None
    t.transfer_done(a)
    assert t.quarantined == 0 and t.free == 1 and t.take(1) == [a]
    t.release(b)
    t.release(b)  # idempotent: never handed out twice
    assert t.free == 1


def test_a_finished_transfer_keeps_an_owned_slot_owned():
    t = SlotTable(1)
    (a,) = t.take(1)
    t.mark_busy(a)
    t.transfer_done(a)
    assert t.free == 0 and t.in_use == 1
    t.release(a)
    assert t.free == 1


def test_take_is_all_or_nothing():
    t = SlotTable(3)
    assert t.take(4) is None and t.free == 3
    assert len(t.take(3)) == 3


@pytest.mark.parametrize(
    "raw, name",
    [
        ({"memkv": {"stagingmb": 1}}, "stagingmb"),
        ({"memkv": {"staging_mb": -1}}, "staging_mb"),
        ({"memkv": {"step_yield_ms": 100}}, "step_yield_ms"),
        ({"memkv": {"store_nice": -1}}, "store_nice"),
        ({"memkv": {"copy_scratch_mb": -1}}, "copy_scratch_mb"),
        ({"memkv": {"copy_scratch_mb": 1.5}}, "copy_scratch_mb"),
        ({"memkv": []}, "'memkv'"),
    ],
)
def test_bad_settings_name_the_key(raw, name):
    with pytest.raises(ConfigError) as info:
        DirectSettings.from_extra_config(raw)
    assert name in str(info.value)


def test_defaults_without_a_memkv_object():
    s = DirectSettings.from_extra_config({"spec_name": "MemKVOffloadingSpec"})
    assert s.staging_bytes == 1 << 30 and s.deadline_s == 5.0  # 1 GiB per engine, all ranks together


# -- the worker's ring (load_guarantee "leased", memkv_vllm.direct.streaming) -----------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_ring_slot_quarantined_after_a_late_landing_failure_comes_back_only_after_the_grace():
    from memkv_vllm.direct.streaming import SlotRing

    clock = _Clock()
    ring = SlotRing([0, 1], clock)
    a, b = ring.take(2)
    ring.quarantine(a, until=10.0)  # an RDMA fetch into `a` failed: a node may still WRITE
    ring.give([b])
    assert ring.take(2, timeout_s=0) == [b]
    assert ring.take(1, timeout_s=0) == [], "a quarantined slot must not be handed out"
    clock.now = 10.0
    assert ring.take(1, timeout_s=0) == [a]


def test_a_failed_fetch_is_retried_into_a_fresh_slot_and_the_failed_one_stays_quarantined():
    from memkv.transport.base import LoadResult
    from memkv_vllm.direct.streaming import Chunk, Job, StreamingTransfers

    clock = _Clock()
    region = bytearray(4 * 8)
    filled: list[int] = []

    class Client:
        calls = 0

        def batch_load_into(self, items):
            Client.calls += 1
            if Client.calls == 1:  # fails, and the transport says a write may still land
                return LoadResult([False] * len(items), may_land_late=True)
            for _, view in items:
                view[:] = b"v" * len(view)
            return LoadResult([True] * len(items), may_land_late=False)

    def section(slot: int) -> memoryview:
        return memoryview(region)[slot * 8 : slot * 8 + 8]

    def copy(items, to_staging):
        filled.extend(slot for _, _, slot in items)

    t = StreamingTransfers(
        Client(), 0, section, 4, copy, blocks_per_op=1, load_retry_s=5.0, load_failure_grace_s=60.0, clock=clock
    )
    try:
        job = Job(1, True, [Chunk(b"k/r0", [])], None, 8)
        t.submit(job)
        assert job.done.wait(10)
        assert job.error is None and Client.calls == 2
        assert filled == [1], "the chunk must be copied from the fresh slot"
        assert t.load_ring.quarantined == 1 and t.load_ring.free == 1
    finally:
        t.shutdown()


class _SlotClient:
    """A client whose fetches fill a slot with its chunk's key byte and record which slot they wrote
    (found from the view's address) while `busy` names the slots whose GPU copy is in flight."""

    def __init__(
        self, region: bytearray, slot_bytes: int, busy: set[int], before_fetch: Callable[[], None] = lambda: None
    ) -> None:
        import numpy as np

        self._np = np
        self._base = np.frombuffer(region, dtype=np.uint8).__array_interface__["data"][0]
        self._slot_bytes = slot_bytes
        self._busy = busy
        self.overwrites: list[int] = []  # slots fetched into while their copy was in flight
        self._before_fetch = before_fetch

    def batch_load_into(self, items):
        from memkv.transport.base import LoadResult

        self._before_fetch()
        for key, view in items:
            addr = self._np.frombuffer(view, dtype=self._np.uint8).__array_interface__["data"][0]
            slot = (addr - self._base) // self._slot_bytes
            if slot in self._busy:
                self.overwrites.append(slot)
            view[:] = key[:1] * len(view)
        return LoadResult([True] * len(items), may_land_late=False)


def _transfers(client, region: bytearray, slot_bytes: int, copy, num_slots: int):
    from memkv_vllm.direct.streaming import StreamingTransfers

    def section(slot: int) -> memoryview:
        return memoryview(region)[slot * slot_bytes : (slot + 1) * slot_bytes]

    return StreamingTransfers(
        client,
        0,
        section,
        num_slots,
        copy,
        blocks_per_op=1,
        load_retry_s=5.0,
        load_failure_grace_s=60.0,
        fetch_threads=2,
    )


def test_the_next_load_batch_is_queued_while_one_is_copied_and_no_slot_is_refilled_before_its_copy_ends():
    """The scatter thread queues a second batch's copies before waiting for the first (the GPU's
    copy engine never idles while the thread waits); a slot goes back to the fetchers only after
    its copy completed, so no fetch overwrites bytes still being copied, and each chunk's bytes
    reach the copy intact."""
    import threading

    from memkv_vllm.direct.streaming import SCATTER_IN_FLIGHT, Chunk, Job

    slot_bytes, num_slots, n_chunks = 8, 16, 40
    region = bytearray(slot_bytes * num_slots)
    busy: set[int] = set()
    queued = threading.Condition()  # guards gates, copied, busy; notified when a batch is queued
    gates: list[threading.Event] = []
    copied: list[bytes] = []
    most_in_flight = 0
    fetched = 0

    def one_fetch_at_a_time():
        """A fetch completes only once every earlier one's chunk is queued for its copy: batches
        of one chunk, so a second batch can exist while the first is copied."""
        nonlocal fetched
        with queued:
            assert queued.wait_for(lambda: len(copied) >= fetched, timeout=10), "an earlier chunk was never copied"
            fetched += 1

    client = _SlotClient(region, slot_bytes, busy, one_fetch_at_a_time)

    def copy(items, to_staging):
        nonlocal most_in_flight
        gate = threading.Event()
        with queued:
            for _, chunk, slot in items:
                seen = bytes(region[slot * slot_bytes : (slot + 1) * slot_bytes])
                assert seen == chunk.key[:1] * slot_bytes, "a slot's bytes changed before its copy"
                copied.append(chunk.key)
                busy.add(slot)
            gates.append(gate)
            most_in_flight = max(most_in_flight, sum(not g.is_set() for g in gates))
            queued.notify_all()

        def wait():
            assert gate.wait(10), "the test never released this copy"
            with queued:
                for _, chunk, slot in items:
                    assert bytes(region[slot * slot_bytes : (slot + 1) * slot_bytes]) == chunk.key[:1] * slot_bytes
                    busy.discard(slot)

        return wait

    stop = threading.Event()

    def copy_engine():
        """Completes the queued copies in order, each only once the batch after it is queued (or
        every chunk is), so that the overlap asserted below does not depend on how fast the
        threads run. Each wait is bounded (10 s)."""
        done = 0
        while not stop.is_set():
            with queued:
                queued.wait_for(
                    lambda done=done: (
                        stop.is_set() or len(gates) > done + 1 or (done < len(gates) and len(copied) == n_chunks)
                    ),
                    timeout=10,
                )
                gate = gates[done] if done < len(gates) else None
            if gate is None:
                continue
            gate.set()
            done += 1

    engine = threading.Thread(target=copy_engine, daemon=True)
    engine.start()
    t = _transfers(client, region, slot_bytes, copy, num_slots)
    try:
        keys = [bytes([65 + i]) + b"/r0" for i in range(n_chunks)]
        job = Job(1, True, [Chunk(k, []) for k in keys], None, n_chunks * slot_bytes)
        t.submit(job)
        assert job.done.wait(20), "the load never completed"
        assert job.error is None
        assert sorted(copied) == sorted(keys), "every chunk copied exactly once"
        assert client.overwrites == [], f"slots {client.overwrites} were fetched into during their copy"
        assert most_in_flight >= 2, "the next batch must be queued while one is copied"
        assert most_in_flight <= SCATTER_IN_FLIGHT, "more batches queued than the bound"
        assert t.load_ring.free == t.load_ring.size
    finally:
        stop.set()
        with queued:
            queued.notify_all()
            for g in gates:
                g.set()
        t.shutdown()


def test_a_copy_whose_wait_fails_fails_its_job_and_gives_its_slots_back():
    from memkv_vllm.direct.streaming import Chunk, Job

    slot_bytes, num_slots = 8, 4
    region = bytearray(slot_bytes * num_slots)
    client = _SlotClient(region, slot_bytes, set())

    def copy(items, to_staging):
        def wait():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        return wait

    t = _transfers(client, region, slot_bytes, copy, num_slots)
    try:
        job = Job(1, True, [Chunk(b"A/r0", []), Chunk(b"B/r0", [])], None, 2 * slot_bytes)
        t.submit(job)
        assert job.done.wait(10)
        assert job.error is not None and "internal error in scatter" in job.error
        assert "illegal memory access" in job.error
        assert t.load_ring.free == t.load_ring.size
    finally:
        t.shutdown()


def test_put_threads_run_at_store_nice_and_fetch_threads_at_the_engines():
    """Stores are background work: a worker's put threads yield the CPU (memkv_vllm/priority.py);
    its fetches serve a waiting request and keep the engine's nice."""
    import os
    import threading

    from memkv.transport.base import LoadResult
    from memkv_vllm.direct.streaming import Chunk, Job, StreamingTransfers

    engine_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    region = bytearray(8 * 4)
    stored: dict[bytes, bytes] = {}
    nices: dict[str, set[int]] = {"put": set(), "fetch": set()}

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    class Client:
        def batch_put_views(self, items):
            nices["put"].add(nice())
            stored.update((key, bytes(view)) for key, view in items)
            return [True] * len(items)

        def batch_load_into(self, items):
            nices["fetch"].add(nice())
            for key, view in items:
                view[:] = stored[key]
            return LoadResult([True] * len(items), may_land_late=False)

    def section(slot: int) -> memoryview:
        return memoryview(region)[slot * 8 : slot * 8 + 8]

    def copy(items, to_staging):
        for _, chunk, slot in items:
            if to_staging:
                section(slot)[:] = chunk.key[:1] * 8

    t = StreamingTransfers(
        Client(), 0, section, 4, copy, 1, load_retry_s=5.0, load_failure_grace_s=60.0, put_threads=2, put_nice=4
    )
    try:
        store = Job(1, False, [Chunk(b"A/r0", []), Chunk(b"B/r0", [])], None, 16)
        t.submit(store)
        assert store.done.wait(10) and store.failed_puts == 0
        load = Job(2, True, [Chunk(b"A/r0", []), Chunk(b"B/r0", [])], None, 16)
        t.submit(load)
        assert load.done.wait(10) and load.error is None
        assert stored == {b"A/r0": b"A" * 8, b"B/r0": b"B" * 8}
        assert nices == {"put": {min(19, engine_nice + 4)}, "fetch": {engine_nice}}
    finally:
        t.shutdown()
