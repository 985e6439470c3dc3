"""`MemKVSecondaryTierManager`: a MemKV cluster as a secondary tier of TieringOffloadingSpec.

Data path. One MemKV value = one CPU-pool row = one offloaded chunk across all TP ranks
(`primary_kv_view.strides[0]` bytes). Store (cascade) sends the rows straight from the pool
(`Client.batch_put_views` on row slices); load (promotion) receives straight into the
destination rows (`Client.batch_load_into`; with the RDMA transport the nodes WRITE into the
rows of the pool registered at startup, docs/rdma.md), full-length and checksum-verified or
the block fails. Jobs are cut into tasks of `blocks_per_op` rows on priority threads (transfers.py).

Store admission (admission.py): vLLM hands the tier each request's chunks as one job per prefill
step, a *set* of keys in hash order, and its prefix lookup stops at the first missing chunk. So a
job is stored or shed whole, and once a request has a shed job its later jobs are shed too: what
the tier holds for a request is always a usable prefix. The backlog bound defaults to half of
the CPU pool.

Contracts with vLLM (base.py of the tiering framework):
  * every method below runs on the scheduler side and returns without waiting on the network;
  * every submitted job is reported exactly once by get_finished_jobs (empty jobs at once);
  * no byte is written into a row after vLLM got it back: a task returns only when its socket
    reads are over. A failed load that may still land (RDMA), or one with a transfer unanswered
    after lookup_timeout_s, is reported at once on 0.34+ with JobResult.deferred_release set only
    when no byte can arrive; before 0.34 its report is withheld for load_failure_grace_s;
  * drain_jobs blocks until every result can be taken.

Failure isolation: a node that is down or slow makes lookups of its blocks answer MISS (the
client's down mark, and this tier's lookup_timeout_s deadline on every vLLM release), while the
other nodes' blocks keep answering at once (lookup.py: answers are taken per node as they
arrive); a failed load purges
its keys from MemKV and is remembered as a miss, so it recomputes and re-stores once rather
than looping; store jobs over the backlog bound are shed whole (admission.py); loads never are.

Threading: see the docstrings of LookupService and TransferPool. This class keeps no state of
its own that worker threads write, except through those two and TierStats.
"""

from __future__ import annotations

import logging
from typing import Any

from memkv_vllm import compat
from memkv_vllm import metrics as tm
from memkv_vllm.admission import StoreAdmission
from memkv_vllm.config import TierSettings
from memkv_vllm.gil import SwitchInterval
from memkv_vllm.keys import KeyNamespace
from memkv_vllm.lookup import LookupService
from memkv_vllm.startup import Startup
from memkv_vllm.transfers import LOAD, STORE, TaskResult, TransferPool

log = logging.getLogger("vllm.memkv_vllm")


class MemKVSecondaryTierManager(compat.SecondaryTierManager):
    """The `memkv` tier. Tier keys: see memkv_vllm.config.TierSettings."""

    # 0.27+: what the tier is made of (memory), for TierFilter; 0.32+: not the local CPU pool.
    if compat.TIER_MEDIUM is not None:
        medium = compat.TIER_MEDIUM
    if compat.TIER_CACHE_HIT_SOURCE is not None:
        cache_hit_source = compat.TIER_CACHE_HIT_SOURCE

    def __init__(
        self,
        offloading_spec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **tier_config: Any,
    ) -> None:
        # Validate everything cheap before touching the network or allocating anything.
        self.settings = TierSettings.from_tier_config(tier_config)
        compat.init_base(self, offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = compat.parse_locality(self.settings.locality)
        assert primary_kv_view.strides is not None, "primary_kv_view.strides cannot be None"
        self.row_bytes = primary_kv_view.strides[0]
        pool_bytes = primary_kv_view.nbytes
        startup = Startup("MemKV tier", log)
        self.client = startup.open_client()
        try:
            startup.probe(self.client, self.row_bytes, "a CPU-pool row")
            self.namespace = KeyNamespace(self.settings.prefix, offloading_spec, self.row_bytes)
            startup.write_config_record(self.client, self.namespace.config_key, self.namespace.config_record())
            pool = primary_kv_view.cast("B")  # RDMA: the whole pool, once; the client keeps its range, not a view
            try:
                startup.register_pool(self.client, pool)
            finally:
                pool.release()
        except BaseException:
            self.client.close()
            raise
        self._rows = primary_kv_view.cast("B")  # flat bytes of the whole pool; rows are slices
        self.stats = tm.TierStats(mode="tier")
        self._admission = StoreAdmission(self.settings.store_backlog_bytes(pool_bytes))
        backlog_mb = self._admission.limit_bytes >> 20
        if self.settings.max_store_backlog_mb is not None and self._admission.limit_bytes > pool_bytes // 2:
            log.warning(
                "MemKV tier: max_store_backlog_mb=%d is more than half of the CPU pool (%d MiB): stores in "
                "flight may pin most of the pool's rows; keep it below half of cpu_bytes_to_use",
                backlog_mb,
                pool_bytes >> 20,
            )
        # 0.34+: a failed or overdue promotion is reported at once and its rows held back through
        # JobResult.deferred_release; before, its report is withheld (transfers.py).
        self._pool = TransferPool(
            self.settings.n_read_threads,
            self.settings.n_write_threads,
            self.settings.load_failure_grace_s,
            defer_release=compat.HAS_DEFERRED_RELEASE,
            load_deadline_s=self.settings.lookup_deadline_s,
            store_nice=self.settings.store_nice,
        )
        self._lookup = LookupService(
            self.client.exists_stream,
            self.settings.lookup_deadline_s,
            on_timeout=lambda n: self.stats.count(tm.LOOKUPS, n, ("timeout",)),
            store_keys=self.namespace.keys,
        )
        self._gil = SwitchInterval(self.settings.step_yield_ms / 1000.0)
        self._closed = False
        startup.warn_block_hashes("blocks")
        s = self.settings
        startup.ready(
            self.client,
            "block_bytes=%d, namespace=%s, n_read_threads=%d, n_write_threads=%d, "
            "blocks_per_op=%d, lookup_timeout_s=%s, max_store_backlog_mb=%d%s, store_nice=%d",
            self.row_bytes,
            self.namespace.namespace,
            s.n_read_threads,
            s.n_write_threads,
            s.blocks_per_op,
            s.lookup_timeout_s,
            backlog_mb,
            "" if s.max_store_backlog_mb is not None else " (half the CPU pool)",
            s.store_nice,
        )

    # ---------------------------------------------------------------------------------------------
    # Lookups
    # ---------------------------------------------------------------------------------------------

    def lookup(self, key, req_context):
        found = self._lookup.lookup(key, req_context.req_id)
        if found is None:
            self.stats.count(tm.LOOKUPS, 1, ("retry",))
            return compat.LookupResult.RETRY
        if found:
            self.stats.count(tm.LOOKUPS, 1, ("hit",))
            return compat.LookupResult.HIT
        if not self._lookup.was_timeout(key):
            self.stats.count(tm.LOOKUPS, 1, ("miss",))
        return compat.LookupResult.MISS

    def on_schedule_end(self, context) -> None:
        self._lookup.flush()
        self._admission.end_step()
        # While a lookup or promotion is in flight, its threads get the GIL within step_yield_ms
        # of asking, and this step never waits for them (gil.py says why).
        self._gil.hold(self._lookup.probing() or self._pool.loading())

    def on_request_finished(self, req_context) -> None:
        self._lookup.cleanup(req_context.req_id)
        self._admission.forget(req_context.req_id)

    def on_new_request(self, req_context):
        return compat.RequestOffloadingContext()

    # ---------------------------------------------------------------------------------------------
    # Transfers
    # ---------------------------------------------------------------------------------------------

    def _row(self, slot: int) -> memoryview:
        start = int(slot) * self.row_bytes
        return self._rows[start : start + self.row_bytes]

    def _tasks(self, keys: list[bytes], slots: list[int], run) -> list:
        """Cut a job into tasks of `blocks_per_op` blocks."""
        step = self.settings.blocks_per_op
        return [
            (lo, len(keys[lo : lo + step]), lambda k=keys[lo : lo + step], s=slots[lo : lo + step]: run(k, s))
            for lo in range(0, len(keys), step)
        ]

    def submit_store(self, job_metadata) -> None:
        keys = list(job_metadata.keys)
        slots = [int(s) for s in compat.job_slot_ids(job_metadata)]
        if keys and not self._admission.admit(job_metadata.req_context.req_id, len(keys), len(keys) * self.row_bytes):
            # Shed whole (admission.py): reported at once, so its pool rows are unpinned at once.
            self.stats.count(tm.SHEDS, len(keys))
            self._pool.submit(job_metadata.job_id, STORE, keys, [], shed=len(keys))
            return
        self._pool.submit(job_metadata.job_id, STORE, keys, self._tasks(keys, slots, self._store_task))

    def _store_task(self, keys: list[bytes], slots: list[int]) -> TaskResult:
        try:
            mk = self.namespace.keys(keys)
            present = self.client.exists(mk)  # one small round trip saves resending 16 MiB values
            todo = [i for i, p in enumerate(present) if not p]
            ok = list(present)
            if todo:
                stored = self.client.batch_put_views([(mk[i], self._row(slots[i])) for i in todo])
                for i, s in zip(todo, stored):
                    ok[i] = s
                self.stats.count(tm.STORE_BYTES, self.row_bytes * sum(stored))
            return TaskResult(ok)
        finally:
            self._admission.release(len(keys) * self.row_bytes)

    def submit_load(self, job_metadata) -> None:
        keys = list(job_metadata.keys)
        slots = [int(s) for s in compat.job_slot_ids(job_metadata)]
        self._pool.submit(job_metadata.job_id, LOAD, keys, self._tasks(keys, slots, self._load_task))  # never shed

    def _load_task(self, keys: list[bytes], slots: list[int]) -> TaskResult:
        mk = self.namespace.keys(keys)
        result = self.client.batch_load_into([(k, self._row(s)) for k, s in zip(mk, slots)])
        ok = result.ok
        self.stats.count(tm.LOAD_BYTES, self.row_bytes * sum(ok))
        failed = [k for k, good in zip(mk, ok) if not good]
        if failed:
            # Purge: a value that cannot load (evicted, corrupt, another layout) must recompute
            # and re-store once instead of failing the same promotion again.
            self.client.delete(failed)
        # Over TCP the bytes are received by this thread: once the call returned, nothing can land
        # in the rows any more. Over RDMA a failed block whose write may have been posted can:
        # the client says so per call (not has_rdma(), which an `auto` latch turns False while
        # an earlier write may still be in flight), and the pool withholds the job.
        return TaskResult(ok, may_land_late=result.may_land_late)

    def get_finished_jobs(self):
        results = []
        for f in self._pool.take_finished():
            success = all(f.ok)
            self.stats.observe(tm.JOB_SECONDS, f.seconds, (f.kind,))
            if sum(f.ok) + f.shed < len(f.ok):  # a shed block is backpressure, not a failure
                self.stats.count(tm.JOBS_FAILED, 1, (f.kind,))
            if f.kind == LOAD and not success:
                self._lookup.mark_miss([k for k, good in zip(f.keys, f.ok) if not good])
                loaded = [k for k, good in zip(f.keys, f.ok) if good]
                results.append(
                    compat.job_result(
                        f.job_id,
                        False,
                        successful_keys=loaded or None,
                        transfer_time=f.seconds,
                        transfer_bytes=len(loaded) * self.row_bytes,
                        deferred_release=f.release,
                    )
                )
            else:
                if f.kind == STORE:
                    # Stored now: a MISS remembered from before (a failed load, a lookup before the
                    # store) must not hide these keys from the requests still asking for them.
                    self._lookup.forget([k for k, good in zip(f.keys, f.ok) if good], only_misses=True)
                results.append(
                    compat.job_result(
                        f.job_id, success, transfer_time=f.seconds, transfer_bytes=sum(f.ok) * self.row_bytes
                    )
                )
        return results

    def has_pending_work(self) -> bool:
        return self._pool.busy() or self._lookup.pending()

    def drain_jobs(self) -> None:
        self._pool.wait_idle()

    # ---------------------------------------------------------------------------------------------
    # Metrics and lifecycle
    # ---------------------------------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return tm.metric_definitions(mode=True)

    def get_stats(self):
        return self.stats.take()

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("memkv_servers", "memkv_prefix", "memkv_blocks_per_op") if compat.HAS_CONFIG_INFO else ()

    def config_info(self) -> dict[str, Any]:
        return {
            "memkv_servers": ",".join(a.name for a in self.client.servers()),
            "memkv_prefix": self.settings.prefix,
            "memkv_blocks_per_op": self.settings.blocks_per_op,
        }

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._gil.close()
        self._lookup.shutdown()
        self._pool.shutdown()
        self.client.close()
        self._rows.release()  # a live export would keep vLLM's /dev/shm region from closing
