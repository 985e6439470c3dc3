"""The tier's vLLM-independent parts: the transfer pool and the lookup service.

Claims: every job is reported exactly once (empty and wholly shed ones included, at once); a
failed load that could still land is withheld for the grace period and drain waits for it (with
vLLM 0.34's deferred release: reported at once, its event set after the grace period, or when a
transfer that overran the deadline returns; drain sets every event); a
task that raises fails only its blocks; lookups answer None (RETRY) until their answer lands,
one round per flush; answers are used as they arrive, so keys answered early resolve while the
rest of the same round stay pending; a key not answered within the deadline becomes a miss
whose late answer is dropped; a prober that raises costs misses, never the worker; shutdown
closes the prober and stops the thread; mark_miss turns a cached hit into a miss. With
store_nice the write threads run at that nice and only they store (still helping with loads);
without it an idle read thread takes stores.
"""

from __future__ import annotations

import os
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
        pool.submit(
            3, LOAD, [b"c", b"d", b"e"], [(0, 2, lambda: TaskResult([True, True])), (2, 1, lambda: TaskResult([False]))]
        )
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


def test_deferred_release_reports_a_possibly_late_load_at_once_and_sets_its_event_after_the_grace():
    """vLLM 0.34+ mode: the failed load is reported at once (its keys can miss now); only its
    rows wait, through the event, which take_finished sets once the grace period is over."""
    pool = TransferPool(1, 1, grace_s=0.3, defer_release=True)
    try:
        t0 = time.monotonic()
        pool.submit(9, LOAD, [b"a", b"b"], [(0, 2, lambda: TaskResult([True, False], may_land_late=True))])
        (f,) = collect(pool, 1)
        assert f.job_id == 9 and f.ok == [True, False] and f.not_before == 0.0
        assert f.release is not None and not f.release.is_set() and pool.busy()
        assert wait_for(lambda: pool.take_finished() == [] and f.release.is_set())
        assert time.monotonic() - t0 >= 0.3 and not pool.busy()
    finally:
        pool.shutdown()


def test_drain_sets_every_deferred_release_before_it_returns():
    pool = TransferPool(1, 1, grace_s=0.3, defer_release=True)
    try:
        pool.submit(9, LOAD, [b"a"], [(0, 1, lambda: TaskResult([False], may_land_late=True))])
        (f,) = collect(pool, 1)
        assert pool.wait_idle(timeout_s=5)
        assert f.release.is_set()
    finally:
        pool.shutdown()


def test_load_with_a_transfer_past_the_deadline_is_reported_at_once_and_released_when_it_returns():
    """A stalled read: the job is reported failed at the deadline with its finished blocks kept,
    its still-queued task is never run, and its event is set only once the stalled task returned."""
    stalled = threading.Event()
    ran = []
    pool = TransferPool(1, 0, grace_s=30.0, defer_release=True, load_deadline_s=0.2)
    try:
        pool.submit(
            5,
            LOAD,
            [b"a", b"b", b"c"],
            [
                (0, 1, lambda: (ran.append("a"), TaskResult([True]))[1]),
                (1, 1, lambda: (ran.append("b"), stalled.wait(10), TaskResult([True]))[2]),
                (2, 1, lambda: (ran.append("c"), TaskResult([True]))[1]),
            ],
        )
        (f,) = collect(pool, 1)
        assert f.job_id == 5 and f.ok == [True, False, False] and ran == ["a", "b"]
        assert f.release is not None and not pool.loading()
        assert not pool.wait_idle(timeout_s=0.2) and not f.release.is_set()  # the read is still on
        stalled.set()
        assert pool.wait_idle(timeout_s=5) and f.release.is_set()
        assert pool.take_finished() == [] and ran == ["a", "b"]  # reported once; "c" never ran
    finally:
        stalled.set()
        pool.shutdown()


def test_a_job_queued_behind_busy_threads_is_not_failed_by_the_deadline():
    gate = threading.Event()
    pool = TransferPool(1, 0, grace_s=0, defer_release=True, load_deadline_s=0.1)
    try:
        pool.submit(1, STORE, [b"s"], [(0, 1, lambda: (gate.wait(5), TaskResult([True]))[1])])
        assert wait_for(lambda: not pool._queues[STORE])
        pool.submit(2, LOAD, [b"l"], [(0, 1, lambda: TaskResult([True]))])
        time.sleep(0.3)  # three deadlines pass while the load is only queued
        assert pool.take_finished() == []
        gate.set()
        assert {(f.job_id, tuple(f.ok)) for f in collect(pool, 2)} == {(1, (True,)), (2, (True,))}
    finally:
        gate.set()
        pool.shutdown()


def test_loads_are_served_first_by_read_priority_threads():
    order = []
    gate = threading.Event()
    pool = TransferPool(1, 0, grace_s=0)
    try:
        pool.submit(
            1, STORE, [b"s0"], [(0, 1, lambda: (gate.wait(5), order.append("blocker"), TaskResult([True]))[-1])]
        )
        assert wait_for(lambda: not pool._queues[STORE])  # the blocker runs
        pool.submit(2, STORE, [b"s1"], [(0, 1, lambda: (order.append("store"), TaskResult([True]))[-1])])
        pool.submit(3, LOAD, [b"l1"], [(0, 1, lambda: (order.append("load"), TaskResult([True]))[-1])])
        gate.set()
        collect(pool, 3)
        assert order == ["blocker", "load", "store"]
    finally:
        pool.shutdown()


def _recording(ran: list, kind: str, gate: threading.Event | None = None):
    """A one-block task that records (kind, its thread's name, that thread's nice)."""

    def task() -> TaskResult:
        me = threading.current_thread()
        ran.append((kind, me.name, os.getpriority(os.PRIO_PROCESS, me.native_id)))
        if gate is not None:
            gate.wait(5)
        return TaskResult([True])

    return task


def test_with_store_nice_stores_run_only_on_write_threads_at_that_nice():
    """A store waits for the busy write thread rather than run on the idle read thread (at its
    nice it would not yield the CPU); loads run at the engine's nice."""
    engine_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ran: list = []
    gate = threading.Event()
    pool = TransferPool(1, 1, grace_s=0, store_nice=3)
    try:
        pool.submit(1, STORE, [b"s0"], [(0, 1, _recording(ran, "store", gate))])
        assert wait_for(lambda: len(ran) == 1)  # the write thread holds it
        pool.submit(2, STORE, [b"s1"], [(0, 1, _recording(ran, "store"))])
        pool.submit(3, LOAD, [b"l0"], [(0, 1, _recording(ran, "load"))])
        assert [f.job_id for f in collect(pool, 1)] == [3]
        assert len(pool._queues[STORE]) == 1  # the idle read thread left it
        gate.set()
        assert sorted(f.job_id for f in collect(pool, 2)) == [1, 2]
        assert ran == [
            ("store", "memkv-store-0", engine_nice + 3),
            ("load", "memkv-load-0", engine_nice),
            ("store", "memkv-store-0", engine_nice + 3),
        ]
    finally:
        gate.set()
        pool.shutdown()


def test_with_store_nice_write_threads_still_help_with_loads():
    engine_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ran: list = []
    gate = threading.Event()
    pool = TransferPool(1, 1, grace_s=0, store_nice=3)
    try:
        tasks = [(0, 1, _recording(ran, "load", gate)), (1, 1, _recording(ran, "load", gate))]
        pool.submit(1, LOAD, [b"l0", b"l1"], tasks)
        assert wait_for(lambda: len(ran) == 2)  # both threads hold one
        gate.set()
        (done,) = collect(pool, 1)
        assert done.ok == [True, True]
        assert sorted(ran) == [("load", "memkv-load-0", engine_nice), ("load", "memkv-store-0", engine_nice + 3)]
    finally:
        gate.set()
        pool.shutdown()


def test_without_store_nice_an_idle_read_thread_takes_stores():
    ran: list = []
    gate = threading.Event()
    pool = TransferPool(1, 1, grace_s=0)
    try:
        pool.submit(
            1, STORE, [b"s0", b"s1"], [(0, 1, _recording(ran, "store", gate)), (1, 1, _recording(ran, "store", gate))]
        )
        assert wait_for(lambda: len(ran) == 2)
        gate.set()
        collect(pool, 1)
        assert {name for _, name, _ in ran} == {"memkv-load-0", "memkv-store-0"}
    finally:
        gate.set()
        pool.shutdown()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeProber:
    """A Prober (memkv_vllm.lookup) over `answer(keys) -> hits`. Answers at once, or, with
    `hold`, only for the keys that `hold(key)` lets through; the rest wait until `release` is
    set (each poll then delivers them) or close() answers them False."""

    def __init__(self, answer, hold=None, release: threading.Event | None = None) -> None:
        self.answer = answer
        self.hold = hold or (lambda key: False)
        self.release = release or threading.Event()
        self.calls: list[list[bytes]] = []
        self.held: list[tuple[list[int], list[bytes], object]] = []
        self.closed = threading.Event()
        self._woken = threading.Event()

    def submit(self, keys, on_answer) -> None:
        self.calls.append(list(keys))
        now = [i for i, k in enumerate(keys) if not self.hold(k)]
        later = [i for i, k in enumerate(keys) if self.hold(k)]
        if now:
            on_answer(now, self.answer([keys[i] for i in now]))
        if later:
            self.held.append((later, [keys[i] for i in later], on_answer))

    def poll(self, timeout_s=None) -> None:
        if self.held and self.release.is_set():
            held, self.held = self.held, []
            for idx, keys, on_answer in held:
                on_answer(idx, self.answer(keys))
            return
        self._woken.wait(0.01 if self.held else timeout_s)  # held answers: look at `release` again soon
        self._woken.clear()

    def wake(self) -> None:
        self._woken.set()

    def close(self) -> None:
        held, self.held = self.held, []
        for idx, _keys, on_answer in held:
            on_answer(idx, [False] * len(idx))
        self.closed.set()
        self._woken.set()


def test_lookup_is_none_until_the_round_lands_and_one_round_per_flush():
    stored = {b"k1"}
    prober = FakeProber(lambda keys: [k in stored for k in keys])
    svc = LookupService(lambda: prober, deadline_s=5.0)
    try:
        assert svc.lookup(b"k1", "r1") is None
        assert svc.lookup(b"k2", "r2") is None
        svc.flush()
        assert wait_for(lambda: svc.lookup(b"k1", "r1") is not None)
        assert svc.lookup(b"k1", "r1") is True and svc.lookup(b"k2", "r2") is False
        assert prober.calls == [[b"k1", b"k2"]]  # both requests' keys in one exists round
    finally:
        svc.shutdown()


def test_store_keys_maps_the_batch_before_it_is_probed():
    prober = FakeProber(lambda keys: [k == b"ns/k1" for k in keys])
    svc = LookupService(lambda: prober, deadline_s=5.0, store_keys=lambda ks: [b"ns/" + k for k in ks])
    try:
        svc.lookup(b"k1", "r")
        svc.lookup(b"k2", "r")
        svc.flush()
        assert wait_for(lambda: svc.lookup(b"k2", "r") is not None)
        assert svc.lookup(b"k1", "r") is True and svc.lookup(b"k2", "r") is False
        assert prober.calls == [[b"ns/k1", b"ns/k2"]]
    finally:
        svc.shutdown()


def test_answers_are_used_as_they_arrive_and_only_the_silent_keys_wait_for_the_deadline():
    """The keys of a silent node stay pending (None) while the rest of the same round, and of
    later rounds, resolve; at the deadline the silent ones become misses."""
    clock = FakeClock()
    prober = FakeProber(lambda keys: [True] * len(keys), hold=lambda key: key.startswith(b"silent/"))
    svc = LookupService(lambda: prober, deadline_s=2.0, clock=clock)
    try:
        for key in (b"silent/1", b"ok/1", b"ok/2"):
            assert svc.lookup(key, "r1") is None
        svc.flush()
        assert wait_for(lambda: svc.lookup(b"ok/1", "r1") is True)
        assert svc.lookup(b"ok/2", "r1") is True and svc.lookup(b"silent/1", "r1") is None
        assert svc.pending()
        # A later round, while the first is still waiting on the silent node.
        clock.now += 1.0
        assert svc.lookup(b"ok/3", "r2") is None
        svc.flush()
        assert wait_for(lambda: svc.lookup(b"ok/3", "r2") is True)
        assert svc.lookup(b"silent/1", "r1") is None and svc.rounds == 1
        clock.now += 1.0  # the silent key's deadline
        assert svc.lookup(b"silent/1", "r1") is False and svc.was_timeout(b"silent/1")
        assert not svc.pending()
    finally:
        svc.shutdown()


def test_unanswered_probe_becomes_a_miss_at_the_deadline_and_its_late_answer_is_dropped():
    release = threading.Event()
    clock = FakeClock()
    timeouts = []
    prober = FakeProber(lambda keys: [True] * len(keys), hold=lambda key: True, release=release)
    svc = LookupService(lambda: prober, deadline_s=2.0, on_timeout=timeouts.append, clock=clock)
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
    clock = FakeClock()
    prober = FakeProber(lambda keys: [True] * len(keys), hold=lambda key: True)
    svc = LookupService(lambda: prober, deadline_s=None, clock=clock)
    try:
        svc.lookup(b"k", "r")
        svc.flush()
        assert wait_for(lambda: prober.calls)
        clock.now += 3600
        assert svc.lookup(b"k", "r") is None
    finally:
        svc.shutdown()


def test_mark_miss_and_cleanup():
    prober = FakeProber(lambda keys: [True] * len(keys))
    svc = LookupService(lambda: prober, deadline_s=5.0)
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

    def answer(keys):
        calls.append(keys)
        if len(calls) == 1:
            raise ConnectionError("injected")
        return [True] * len(keys)

    svc = LookupService(lambda: FakeProber(answer), deadline_s=5.0)
    try:
        svc.lookup(b"a", "r")
        svc.flush()
        assert wait_for(lambda: svc.lookup(b"a", "r") is False)
        svc.lookup(b"b", "r")
        svc.flush()
        assert wait_for(lambda: svc.lookup(b"b", "r") is True)
    finally:
        svc.shutdown()


def test_a_prober_whose_poll_raises_is_replaced_and_its_pending_keys_miss():
    opened: list[FakeProber] = []

    class Broken(FakeProber):
        def poll(self, timeout_s=None) -> None:
            if self.held:
                raise RuntimeError("injected poll failure")
            super().poll(timeout_s)

    def open_prober():
        prober = (Broken if not opened else FakeProber)(
            lambda keys: [True] * len(keys), hold=lambda key: key == b"held"
        )
        opened.append(prober)
        return prober

    svc = LookupService(open_prober, deadline_s=60.0)
    try:
        svc.lookup(b"held", "r")
        svc.flush()
        assert wait_for(lambda: svc.lookup(b"held", "r") is False)  # a miss, not a 60 s wait
        assert not svc.was_timeout(b"held") and len(opened) == 2 and opened[0].closed.is_set()
        svc.lookup(b"fine", "r")
        svc.flush()
        assert wait_for(lambda: svc.lookup(b"fine", "r") is True)
    finally:
        svc.shutdown()


def test_shutdown_closes_the_prober_and_stops_the_thread():
    prober = FakeProber(lambda keys: [True] * len(keys), hold=lambda key: True)
    svc = LookupService(lambda: prober, deadline_s=5.0)
    svc.lookup(b"k", "r")
    svc.flush()
    assert wait_for(lambda: prober.calls)
    svc.shutdown()
    assert prober.closed.is_set() and not svc._thread.is_alive()


def test_probing_is_true_from_flush_until_every_handed_key_is_answered():
    """The tier yields the GIL each step while `probing()`: it must turn True at flush and back
    to False once the last key (here a silent node's, answered late) has been drained."""
    release = threading.Event()
    prober = FakeProber(lambda keys: [True] * len(keys), hold=lambda key: key.startswith(b"silent/"), release=release)
    svc = LookupService(lambda: prober, deadline_s=None)
    try:
        svc.lookup(b"ok/1", "r")
        svc.lookup(b"silent/1", "r")
        assert not svc.probing()  # looked up, not handed to the worker yet
        svc.flush()
        assert svc.probing()
        assert wait_for(lambda: svc.lookup(b"ok/1", "r") is True)
        assert svc.probing()  # the silent key is still out
        release.set()
        assert wait_for(lambda: svc.lookup(b"silent/1", "r") is True)
        assert not svc.probing()
    finally:
        svc.shutdown()


def test_loading_is_true_only_while_a_load_job_is_unfinished():
    pool = TransferPool(1, 1, grace_s=0.0)
    gate = threading.Event()
    try:
        pool.submit(1, STORE, [b"s"], [(0, 1, lambda: (gate.wait(5), TaskResult([True]))[1])])
        assert not pool.loading()  # stores in flight do not count
        pool.submit(2, LOAD, [b"l"], [(0, 1, lambda: (gate.wait(5), TaskResult([True]))[1])])
        assert pool.loading()
        gate.set()
        assert {f.job_id for f in collect(pool, 2)} == {1, 2}
        assert not pool.loading()
    finally:
        pool.shutdown()
