"""The tier's vLLM-independent parts: the transfer pool and the lookup service.

Claims: every job is reported exactly once (empty and wholly shed ones included, at once); a
failed load that could still land is withheld for the grace period and drain waits for it; a
task that raises fails only its blocks; lookups answer None (RETRY) until the probe round lands,
one round per flush, and a probe that does not answer within the deadline becomes a miss
whose late answer is dropped; mark_miss turns a cached hit into a miss.
"""

from __future__ import annotations

import threading
import time

import pytest

from memkv_vllm.lookup import LookupService
from memkv_vllm.transfers import LOAD, STORE, TaskResult, TransferPool

pytestmark = pytest.mark.unit


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return predicate()


def collect(pool: TransferPool, n: int, timeout_s: float = 5.0):
    got = []
    assert wait_for(lambda: got.extend(pool.take_finished()) or len(got) >= n, timeout_s)
    return got


def test_each_job_is_reported_exactly_once_including_empty_and_shed_ones():
    pool = TransferPool(2, 2, grace_s=0)
    try:
        pool.submit(1, STORE, [], [])  # empty
        pool.submit(2, STORE, [b"a", b"b"], [], shed=2)  # wholly shed
        pool.submit(3, LOAD, [b"c", b"d", b"e"], [(0, 2, lambda: TaskResult([True, True])), (2, 1, lambda: TaskResult([False]))])
        done = collect(pool, 3)
        assert sorted(f.job_id for f in done) == [1, 2, 3]
        by_id = {f.job_id: f for f in done}
        assert by_id[1].ok == [] and by_id[2].ok == [False, False] and by_id[2].shed == 2
        assert by_id[3].ok == [True, True, False]
        time.sleep(0.05)
        assert pool.take_finished() == [] and not pool.busy()
    finally:
        pool.shutdown()


def test_a_raising_task_fails_only_its_own_blocks():
    pool = TransferPool(1, 1, grace_s=0)

    def boom():
        raise RuntimeError("injected")

    try:
        pool.submit(7, STORE, [b"a", b"b", b"c"], [(0, 1, lambda: TaskResult([True])), (1, 2, boom)])
        (f,) = collect(pool, 1)
        assert f.ok == [True, False, False]
    finally:
        pool.shutdown()


def test_failed_load_that_may_land_late_is_withheld_for_the_grace_period():
    pool = TransferPool(1, 1, grace_s=0.3)
    try:
        t0 = time.monotonic()
        pool.submit(9, LOAD, [b"a"], [(0, 1, lambda: TaskResult([False], may_land_late=True))])
        pool.submit(10, LOAD, [b"b"], [(0, 1, lambda: TaskResult([False], may_land_late=False))])
        first = collect(pool, 1)
        assert [f.job_id for f in first] == [10]
        assert pool.wait_idle(timeout_s=5)  # drain waits out the grace period
        assert time.monotonic() - t0 >= 0.3
        assert [f.job_id for f in pool.take_finished()] == [9]
    finally:
        pool.shutdown()


def test_loads_are_served_first_by_read_priority_threads():
    order = []
    gate = threading.Event()
    pool = TransferPool(1, 0, grace_s=0)
    try:
        pool.submit(1, STORE, [b"s0"], [(0, 1, lambda: (gate.wait(5), order.append("blocker"), TaskResult([True]))[-1])])
        assert wait_for(lambda: not pool._queues[STORE])  # the blocker runs
        pool.submit(2, STORE, [b"s1"], [(0, 1, lambda: (order.append("store"), TaskResult([True]))[-1])])
        pool.submit(3, LOAD, [b"l1"], [(0, 1, lambda: (order.append("load"), TaskResult([True]))[-1])])
        gate.set()
        collect(pool, 3)
        assert order == ["blocker", "load", "store"]
    finally:
        pool.shutdown()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lookup_is_none_until_the_round_lands_and_one_round_per_flush():
    stored = {b"k1"}
    calls = []

    def probe(keys):
        calls.append(list(keys))
        return [k in stored for k in keys]

    svc = LookupService(probe, deadline_s=5.0)
    try:
        assert svc.lookup(b"k1", "r1") is None
        assert svc.lookup(b"k2", "r2") is None
        svc.flush()
        assert wait_for(lambda: svc.lookup(b"k1", "r1") is not None)
        assert svc.lookup(b"k1", "r1") is True and svc.lookup(b"k2", "r2") is False
        assert calls == [[b"k1", b"k2"]]  # both requests' keys in one exists round
    finally:
        svc.shutdown()


def test_unanswered_probe_becomes_a_miss_at_the_deadline_and_its_late_answer_is_dropped():
    release = threading.Event()
    clock = FakeClock()
    timeouts = []

    def probe(keys):
        release.wait(5)
        return [True] * len(keys)

    svc = LookupService(probe, deadline_s=2.0, on_timeout=timeouts.append, clock=clock)
    try:
        assert svc.lookup(b"k", "r") is None
        svc.flush()
        clock.now += 1.9
        assert svc.lookup(b"k", "r") is None
        clock.now += 0.2
        assert svc.lookup(b"k", "r") is False and svc.was_timeout(b"k")
        assert timeouts == [1]
        release.set()
        assert wait_for(lambda: svc.rounds == 1)
        assert svc.lookup(b"k", "r") is False  # the late True does not resurrect it
    finally:
        release.set()
        svc.shutdown()


def test_deadline_disabled_keeps_answering_none():
    release = threading.Event()
    clock = FakeClock()
    svc = LookupService(lambda keys: (release.wait(5), [True] * len(keys))[1], deadline_s=None, clock=clock)
    try:
        svc.lookup(b"k", "r")
        svc.flush()
        clock.now += 3600
        assert svc.lookup(b"k", "r") is None
    finally:
        release.set()
        svc.shutdown()


def test_mark_miss_and_cleanup():
    svc = LookupService(lambda keys: [True] * len(keys), deadline_s=5.0)
    try:
        svc.lookup(b"k", "r")
        svc.flush()
        assert wait_for(lambda: svc.lookup(b"k", "r") is True)
        svc.mark_miss([b"k"])
        assert svc.lookup(b"k", "r") is False
        svc.cleanup("r")
        assert svc.lookup(b"k", "r2") is None  # a later request probes again
    finally:
        svc.shutdown()


def test_a_raising_probe_answers_misses_and_the_worker_survives():
    calls = []

    def probe(keys):
        calls.append(keys)
        if len(calls) == 1:
            raise ConnectionError("injected")
        return [True] * len(keys)

    svc = LookupService(probe, deadline_s=5.0)
    try:
        svc.lookup(b"a", "r")
        svc.flush()
        assert wait_for(lambda: svc.lookup(b"a", "r") is False)
        svc.lookup(b"b", "r")
        svc.flush()
        assert wait_for(lambda: svc.lookup(b"b", "r") is True)
    finally:
        svc.shutdown()
