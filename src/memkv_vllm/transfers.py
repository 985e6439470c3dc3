"""Store and load jobs on priority threads, each job reported exactly once.

A job is split into tasks of at most `blocks_per_op` blocks. `n_read_threads` threads take
load tasks first, `n_write_threads` threads take store tasks first; either takes the other
kind when its own queue is empty, so neither starves. With `store_nice` (priority.py) the
write threads run at that much higher a nice, so stores yield the CPU to lookups, loads and the
engine; then the read threads take no store task (at their nice a store would not yield), and
the write threads still help with loads when no store is queued. A task returns one success flag per
block (it never raises: any exception fails all of its blocks). When the last task of a job
returns, the job's `Finished` record is queued; an empty job is queued at submission (a job
with no tasks would otherwise never finish -- vLLM's DualQueueThreadPool has that trap).

A failed load whose transfer could still land in its rows (a transport that writes
asynchronously, such as RDMA) must not give its rows back before no byte can arrive:

* `defer_release` off (vLLM before 0.34): its record carries `not_before` and is withheld until
  then (`grace_s`, load_failure_grace_s), so no byte reaches a row after the job was reported.
* `defer_release` on (0.34+, `JobResult.deferred_release`): it is reported at once with a
  `release` event, which is set `grace_s` later; vLLM fails its keys now and keeps its rows out
  of the free pool until the event is set. A load job with a task running for `load_deadline_s`
  (a stalled socket read, a node that stopped answering) is reported the same way at once, its
  unfinished blocks failed (a task still queued behind busy threads is no reason); its event
  is set when its last task has returned (plus `grace_s` if a write may still land), and its
  queued tasks are not run.

Every event is set by take_finished (each scheduler step) or wait_idle once its time came.

Threading: submit/take_finished/busy/wait_idle/shutdown from the scheduler thread; tasks on
the pool's threads. `_cond` guards the queues, the job table and the finished list.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

from memkv_vllm import priority

log = logging.getLogger("vllm.memkv_vllm.transfers")

LOAD, STORE = "load", "store"


@dataclasses.dataclass
class TaskResult:
    ok: list[bool]  # one flag per block of the task
    may_land_late: bool = False  # a failed transfer might still write into its rows


@dataclasses.dataclass
class Finished:
    job_id: int
    kind: str
    keys: list[bytes]
    ok: list[bool]
    seconds: float
    not_before: float = 0.0
    shed: int = 0  # blocks never attempted (store backlog full); their `ok` is False
    release: threading.Event | None = None  # set once no byte can reach the failed blocks' rows


class _Job:
    __slots__ = ("job_id", "kind", "keys", "ok", "remaining", "started", "may_land_late", "shed", "release", "running")

    def __init__(self, job_id: int, kind: str, keys: list[bytes], n_tasks: int, shed: int) -> None:
        self.job_id = job_id
        self.kind = kind
        self.keys = keys
        self.ok = [False] * len(keys)  # blocks no task covers stay False
        self.remaining = n_tasks
        self.started = time.monotonic()
        self.may_land_late = False
        self.shed = shed
        self.release: threading.Event | None = None  # set when reported before its tasks ended
        self.running: dict[int, float] = {}  # first block index of each running task -> its start


class TransferPool:
    def __init__(
        self,
        n_read_threads: int,
        n_write_threads: int,
        grace_s: float,
        *,
        defer_release: bool = False,
        load_deadline_s: float | None = None,
        store_nice: int = 0,
    ) -> None:
        self._grace_s = grace_s
        self._store_nice = store_nice
        self._defer_release = defer_release
        self._load_deadline_s = load_deadline_s if defer_release else None
        self._releases: list[tuple[float, threading.Event]] = []  # (when to set it, event)
        self._cond = threading.Condition()
        self._queues: dict[str, collections.deque] = {LOAD: collections.deque(), STORE: collections.deque()}
        self._jobs: dict[int, _Job] = {}
        self._finished: list[Finished] = []
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._run, args=(LOAD,), name=f"memkv-load-{i}", daemon=True)
            for i in range(n_read_threads)
        ] + [
            threading.Thread(target=self._run, args=(STORE,), name=f"memkv-store-{i}", daemon=True)
            for i in range(n_write_threads)
        ]
        for t in self._threads:
            t.start()

    # -- scheduler side ----------------------------------------------------------------------------

    def submit(
        self,
        job_id: int,
        kind: str,
        keys: list[bytes],
        tasks: Sequence[tuple[int, int, Callable[[], TaskResult]]],
        shed: int = 0,
    ) -> None:
        """`tasks`: (first block index, block count, callable). Blocks no task covers were
        shed by the caller (`shed` of them) and report failure."""
        with self._cond:
            if not tasks:  # an empty job succeeds at once; a wholly shed one fails at once
                self._finished.append(Finished(job_id, kind, keys, [not shed] * len(keys), 0.0, shed=shed))
                return
            self._jobs[job_id] = _Job(job_id, kind, keys, len(tasks), shed)
            for lo, n, fn in tasks:
                self._queues[kind].append((job_id, lo, n, fn))
            # All: a thread woken for a kind it does not take (a read thread, for stores, with
            # store_nice) would go back to waiting and leave the task to nobody.
            self._cond.notify_all()

    def take_finished(self) -> list[Finished]:
        now = time.monotonic()
        with self._cond:
            if self._load_deadline_s is not None:
                self._report_overdue_loads(now)
            self._set_due_releases(now)
            ready = [f for f in self._finished if f.not_before <= now]
            if len(ready) != len(self._finished):
                self._finished = [f for f in self._finished if f.not_before > now]
            else:
                self._finished = []
            return ready

    def busy(self) -> bool:
        with self._cond:
            return bool(self._jobs or self._finished or self._releases)

    def loading(self) -> bool:
        """True while some load (promotion) job is unreported: a request is waiting on it."""
        with self._cond:
            return any(job.kind == LOAD and job.release is None for job in self._jobs.values())

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until every submitted job's result can be taken (withheld ones included)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                now = time.monotonic()
                self._set_due_releases(now)
                held = [f.not_before for f in self._finished if f.not_before > now]
                held += [at for at, _ in self._releases]
                if not self._jobs and not held:
                    return True
                wait = None if not held else max(held) - now
                if deadline is not None:
                    left = deadline - now
                    if left <= 0:
                        return False
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            for q in self._queues.values():
                q.clear()
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # -- pool threads ------------------------------------------------------------------------------

    def _run(self, preferred: str) -> None:
        if preferred == STORE:
            priority.lower_this_thread(self._store_nice)
        kinds = [preferred]
        if preferred == STORE or not self._store_nice:
            kinds.append(STORE if preferred == LOAD else LOAD)
        queues = [self._queues[kind] for kind in kinds]
        while True:
            with self._cond:
                while not self._stopping and not any(queues):
                    self._cond.wait()
                if self._stopping:
                    return
                q = next(q for q in queues if q)
                job_id, lo, n, fn = q.popleft()
                job = self._jobs[job_id]
                abandoned = job.release is not None
                if not abandoned:
                    job.running[lo] = time.monotonic()
            if abandoned:  # reported failed already: its rows wait for this job, not for the data
                self._task_done(job_id, lo, TaskResult([False] * n))
                continue
            try:
                result = fn()
                if len(result.ok) != n:
                    raise RuntimeError(f"task returned {len(result.ok)} flags for {n} blocks")
            except Exception:
                log.exception("memkv transfer task failed")
                result = TaskResult([False] * n)
            self._task_done(job_id, lo, result)

    def _task_done(self, job_id: int, lo: int, result: TaskResult) -> None:
        with self._cond:
            job = self._jobs[job_id]
            job.running.pop(lo, None)
            job.ok[lo : lo + len(result.ok)] = result.ok
            job.may_land_late |= result.may_land_late and not all(result.ok)
            job.remaining -= 1
            if job.remaining:
                return
            del self._jobs[job_id]
            now = time.monotonic()
            late = job.kind == LOAD and job.may_land_late and self._grace_s > 0
            if job.release is not None:  # reported at its deadline: its rows come back now
                self._hold_release(job.release, now + self._grace_s if late else now)
            elif late and self._defer_release:
                release = threading.Event()
                self._hold_release(release, now + self._grace_s)
                self._finished.append(
                    Finished(job_id, job.kind, job.keys, job.ok, now - job.started, 0.0, job.shed, release)
                )
            else:
                self._finished.append(
                    Finished(
                        job_id,
                        job.kind,
                        job.keys,
                        job.ok,
                        now - job.started,
                        now + self._grace_s if late else 0.0,
                        job.shed,
                    )
                )
            self._cond.notify_all()

    # -- deferred releases (under _cond) -------------------------------------------------------------

    def _report_overdue_loads(self, now: float) -> None:
        """Report every load job with a transfer running past the deadline as failed (unfinished
        blocks False), at once."""
        assert self._load_deadline_s is not None
        for job in self._jobs.values():
            if job.kind != LOAD or job.release is not None or not job.running:
                continue
            if now - min(job.running.values()) >= self._load_deadline_s:
                job.release = threading.Event()
                log.warning(
                    "MemKV tier: promotion job %d has a transfer unanswered after %.1f s (lookup_timeout_s): "
                    "its keys miss now; its rows return to the pool when its transfers have ended",
                    job.job_id,
                    now - min(job.running.values()),
                )
                self._finished.append(
                    Finished(job.job_id, LOAD, job.keys, list(job.ok), now - job.started, 0.0, job.shed, job.release)
                )

    def _hold_release(self, event: threading.Event, at: float) -> None:
        if at <= time.monotonic():
            event.set()
        else:
            self._releases.append((at, event))

    def _set_due_releases(self, now: float) -> None:
        if not self._releases:
            return
        due = [event for at, event in self._releases if at <= now]
        for event in due:
            event.set()
        if due:
            self._releases = [(at, event) for at, event in self._releases if at > now]
