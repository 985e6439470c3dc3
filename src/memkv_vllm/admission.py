"""Which cascaded store jobs the tier takes: whole jobs, and for each request a prefix of them.

Why whole jobs. vLLM's offloading connector makes one store job per request per scheduler step
(the chunks that step completed) and hands it to the tier as a *set* of keys
(`keys=set(keys_to_store)` in every release 0.25.0-0.33.0), so the order of a job's keys is hash
order, not prompt order. Its prefix lookup (`_maximal_prefix_lookup`) stops at the first chunk
that misses. A tier that admitted a job's blocks one task at a time in the order given and shed
the rest stored a random subset of the prompt, of which the usable prefix was close to nothing
(measured on an H200: 32 MiB of a 32k-token prompt's 8 GiB promoted). So a job is admitted or
shed as a whole, and the decision never looks at the order of its keys.

Why a prefix per request. Once a job of a request has been shed, every chunk after it is
unreachable by the prefix lookup, so every later job of that request is shed too (and is
counted as shed). What the tier holds for a request is therefore always the leading jobs of its
prompt: usable from the first block to the last.

Why per step, not per job. Jobs of one request reach the tier in prompt order from one scheduler
step to the next, but not always within a step: with tensor parallelism a job completes when
the last rank reports it, vLLM merges the ranks' reports rank by rank, so when one rank lags,
the jobs it catches up on complete in one step in any order (seen through vLLM's real connector:
2, 0, 1). Across steps the order holds, because each rank reports its jobs in order. So the
jobs of a request that arrive within one step (between two `end_step` calls) are admitted or
shed together: the first one decides, the others follow it, even past the bound. The bound can
be overshot only by the other jobs of a request already admitted in the same step.

Why started requests come first. A request whose first job is admitted may fill the whole
backlog; a request that has stored nothing yet starts only while the backlog, with its job, stays
within `new_request_share` of the bound (half by default). Under load the room goes to finishing
prompts already under way, so requests degrade one by one -- most kept whole, the newest shed
from their start -- rather than every concurrent prompt being cut short.

Why shed at all. The manager pins a job's CPU-pool rows until the tier reports the job; stores
queued or in flight hold those rows, and a pool whose rows are all pinned can store nothing new.
The backlog (bytes of admitted jobs not yet stored) is bounded by `limit_bytes`
(`max_store_backlog_mb`; by default half of the CPU pool, the rule the seed page gives for the
key). An empty backlog admits any job, so a single job larger than the limit is still stored
whole rather than never.

Not covered: blocks that vLLM itself never cascades for a request (chunks already in the CPU
pool from another request, or cascades skipped by vLLM's own backpressure detector on 0.31+)
and blocks lost after storing (eviction on the nodes, a node down) can still leave a request's
chunks in MemKV after a hole; that is capacity or an outage, not an admission decision.

Threading: `admit` and `forget` run on the scheduler thread (0.33: under the manager lock);
`release` runs on the transfer threads; `end_step` runs on the scheduler side once per step. `_lock`
guards `_backlog_bytes`; `_started`, `_this_step` and `_cut` (requests with an admitted job, with
one admitted in this step, whose jobs are shed from now on) and the warning state belong to the
scheduler side. They hold only unfinished requests (`forget`; `_this_step` is emptied each step).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("vllm.memkv_vllm")

WARN_INTERVAL_S = 30.0  # at most one shed WARNING per interval; the counter has every block
NEW_REQUEST_SHARE = 0.5  # of the bound, the most a request's first job may bring the backlog to


class StoreAdmission:
    """Per-request, whole-job admission of store jobs against a byte budget."""

    def __init__(
        self,
        limit_bytes: int,
        *,
        new_request_share: float = NEW_REQUEST_SHARE,
        warn_interval_s: float = WARN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be > 0, got {limit_bytes}")
        if not 0 < new_request_share <= 1:
            raise ValueError(f"new_request_share must be in (0, 1], got {new_request_share}")
        self.limit_bytes = limit_bytes
        self._new_request_bytes = int(limit_bytes * new_request_share)
        self._lock = threading.Lock()
        self._backlog_bytes = 0
        self._started: set[str] = set()
        self._this_step: set[str] = set()
        self._cut: set[str] = set()
        self._clock = clock
        self._warn_interval_s = warn_interval_s
        self._next_warning = 0.0
        self._unreported_blocks = 0
        self._unreported_requests: set[str] = set()

    @property
    def backlog_bytes(self) -> int:
        with self._lock:
            return self._backlog_bytes

    def admit(self, req_id: str, n_blocks: int, nbytes: int) -> bool:
        """True: the job (`n_blocks` blocks, `nbytes` bytes) is taken whole and its bytes join
        the backlog until `release`d. False: it is shed whole, as is every later job of
        `req_id` until `forget(req_id)`."""
        if req_id in self._cut:
            self._shed(req_id, n_blocks, nbytes, reason="an earlier store job of this request was shed")
            return False
        if req_id in self._this_step:  # its order within the step is unknown: follow the step's first job
            with self._lock:
                self._backlog_bytes += nbytes
            return True
        started = req_id in self._started
        bound = self.limit_bytes if started else self._new_request_bytes
        with self._lock:
            backlog = self._backlog_bytes
            if not backlog or backlog + nbytes <= bound:
                self._backlog_bytes += nbytes
                admitted = True
            else:
                admitted = False
        if admitted:
            self._started.add(req_id)
            self._this_step.add(req_id)
            return True
        self._started.discard(req_id)
        self._cut.add(req_id)
        self._shed(req_id, n_blocks, nbytes, reason=f"the store backlog holds {backlog >> 20} MiB")
        return False

    def end_step(self) -> None:
        """A scheduler step ended: jobs from now on come after every job seen so far."""
        self._this_step.clear()

    def release(self, nbytes: int) -> None:
        """Bytes of an admitted job that are no longer queued or in flight."""
        with self._lock:
            self._backlog_bytes -= nbytes

    def forget(self, req_id: str) -> None:
        """The request is finished: no more store jobs of it can come."""
        self._started.discard(req_id)
        self._this_step.discard(req_id)
        self._cut.discard(req_id)

    def _shed(self, req_id: str, n_blocks: int, nbytes: int, reason: str) -> None:
        self._unreported_blocks += n_blocks
        self._unreported_requests.add(req_id)
        now = self._clock()
        if now < self._next_warning:
            return
        self._next_warning = now + self._warn_interval_s
        log.warning(
            "MemKV tier: shed %d block(s) of %d request(s) (last: %s, %d MiB: %s); a request keeps only the "
            "store jobs before its first shed one. Raise max_store_backlog_mb (now %d MiB; keep it below half of "
            "cpu_bytes_to_use), or add n_write_threads or nodes. vllm:kv_offload_memkv_sheds counts every block.",
            self._unreported_blocks,
            len(self._unreported_requests),
            req_id,
            nbytes >> 20,
            reason,
            self.limit_bytes >> 20,
        )
        self._unreported_blocks = 0
        self._unreported_requests.clear()
