"""The staging slot table's quarantine rule and the direct-mode keys, as plain logic.

A slot is handed out again only when its owner released it *and* no transfer can still touch
it; released-while-busy is "quarantined". (In tests/conformance because importing
memkv_vllm.direct imports vLLM.)"""

from __future__ import annotations

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


@pytest.mark.parametrize("raw, name", [
    ({"memkv": {"stagingmb": 1}}, "stagingmb"),
    ({"memkv": {"staging_mb": -1}}, "staging_mb"),
    ({"memkv": {"step_yield_ms": 100}}, "step_yield_ms"),
    ({"memkv": {"copy_scratch_mb": -1}}, "copy_scratch_mb"),
    ({"memkv": {"copy_scratch_mb": 1.5}}, "copy_scratch_mb"),
    ({"memkv": []}, "'memkv'"),
])
def test_bad_settings_name_the_key(raw, name):
    with pytest.raises(ConfigError) as info:
        DirectSettings.from_extra_config(raw)
    assert name in str(info.value)


def test_defaults_without_a_memkv_object():
    s = DirectSettings.from_extra_config({"spec_name": "MemKVOffloadingSpec"})
    assert s.staging_bytes == 512 << 20 and s.deadline_s == 5.0


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

    t = StreamingTransfers(Client(), 0, section, 4, copy, blocks_per_op=1, load_retry_s=5.0,
                           load_failure_grace_s=60.0, clock=clock)
    try:
        job = Job(1, True, [Chunk(b"k/r0", [])], None, 8)
        t.submit(job)
        assert job.done.wait(10)
        assert job.error is None and Client.calls == 2
        assert filled == [1], "the chunk must be copied from the fresh slot"
        assert t.load_ring.quarantined == 1 and t.load_ring.free == 1
    finally:
        t.shutdown()
