"""Headless engine around vLLM's real OffloadingConnector, scheduler side (vLLM 0.25.0 - 0.34.0).

The manager-level harness (vllm_harness.HeadlessEngine) calls the offloading manager itself,
with keys in prompt order, one job at a time. This one sits one level up, where the engine
sits: it calls the connector, and the connector calls the manager. Job shapes are therefore
exactly vLLM's: one store job per request per step, holding the chunks that step completed as
a *set* of keys before 0.34 (so a tier sees them in hash-set order) and in prompt order from
0.34 (harness_compat.STORE_JOB_KEYS_IN_PROMPT_ORDER); prefix lookups that stop at the first
miss and defer on RETRY/HIT_PENDING; cascades when workers report; finished requests, resets.

What is real and what is simulated:

* Real: ``OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)`` and
  its ``OffloadingConnectorScheduler``; the spec the wrapper builds from
  ``kv_connector_extra_config`` exactly as a user writes it (``spec_name``,
  ``cpu_bytes_to_use``, ``block_size``, ``secondary_tiers``); ``TieringOffloadingManager``, the
  CPU primary pool in ``/dev/shm`` and every secondary tier; a real ``KVCacheConfig``; real
  ``RequestStatus`` values; ``KVConnectorOutput`` and ``OffloadingWorkerMetadata``.
* Simulated, the engine's scheduler loop: scheduler_standin.SchedulerStandIn, shared with the
  direct harness (its docstring says what it does and leaves out).
* Simulated, the ``VllmConfig``: a namespace with the attributes the connector reads
  (vllm-connector-api.md section 1).
* Simulated, the GPU workers: a store job writes each chunk's deterministic bytes
  (``vllm_harness.payload_for`` of the chunk's key) into its destination primary row; a load job
  reads each source row and checks it byte for byte against the bytes of the chunk its GPU
  blocks belong to (AssertionError otherwise), and is reported done in the step it ran.
  Completions go back the way workers report them,
  ``KVConnectorOutput(kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=...))``,
  one report per simulated worker (``world_size``). Store reports can be deferred by N steps or
  held and released in bulk, so that several store jobs reach the tier in one step.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import OffloadKey

from tests.conformance import vllm_harness as h
from tests.conformance.scheduler_standin import SchedulerStandIn, StandInRequest, WorkerReport, prompt_keys, vllm_config

__all__ = [
    "ConnectorEngine",
    "EngineRequest",
    "StoreJob",
    "prompt_keys",
]


class EngineRequest(StandInRequest):
    """A request, plus what the simulated workers recorded about it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.loaded_chunks: list[int] = []  # chunk indices loaded from the primary pool
        self.stored_chunks: list[int] = []  # chunk indices written into primary rows
        self.store_jobs: list[StoreJob] = []


@dataclasses.dataclass
class StoreJob:
    """One store job the connector built, as the simulated worker saw it."""

    job_id: int
    req_id: str
    step: int
    chunks: list[int]  # chunk indices, in the order of the job's rows (prompt order)
    key_order: list[int]  # the same chunks in the iteration order of the connector's job keys


@dataclasses.dataclass
class _PendingReport:
    job_id: int
    due_step: int


class ConnectorEngine(SchedulerStandIn):
    """vLLM's real OffloadingConnector (scheduler role) inside the stand-in scheduler loop.

    Use as a context manager, or call shutdown(). ``token_budget`` is the scheduler's
    max_num_batched_tokens: a prompt longer than that is prefilled in several steps, and so
    reaches the manager as several store jobs; ``long_prefill_token_threshold`` caps one request's
    tokens per step (vLLM's scheduler key of that name), so that several long prompts prefill side
    by side, each with a store job per step. ``store_report_delay_steps`` is how many steps
    after its submission a store job is reported complete (1: the worker's transfer finished by
    the next step, as vLLM's worker defers stores to the next step's start).
    """

    request_type = EngineRequest

    def __init__(
        self,
        secondary_tiers: Sequence[Mapping[str, Any]],
        geometry: h.Geometry = h.Geometry(),  # noqa: B008 (frozen)
        *,
        token_budget: int = 2048,
        long_prefill_token_threshold: int | None = None,
        store_report_delay_steps: int = 1,
        extra_config: Mapping[str, Any] | None = None,
        engine_id: str | None = None,
        model_name: str = h.DEFAULT_MODEL_NAME,
        step_sleep_s: float = 0.002,
    ) -> None:
        if token_budget < 1 or store_report_delay_steps < 0:
            raise ValueError("token_budget must be >= 1 and store_report_delay_steps >= 0")
        self._closed = False
        self.store_report_delay_steps = store_report_delay_steps
        engine_id = engine_id or f"conn-{uuid.uuid4().hex[:12]}"
        self.config = h.tiering_config(secondary_tiers, geometry, **dict(extra_config or {}))
        self.vllm_config = vllm_config(
            self.config, geometry, engine_id, model=model_name, dtype="bfloat16", num_kv_heads=1
        )
        self.kv_cache_config = h.build_kv_cache_config(geometry, num_gpu_blocks=_GPU_BLOCKS)
        connector = OffloadingConnector(self.vllm_config, KVConnectorRole.SCHEDULER, self.kv_cache_config)
        super().__init__(
            connector,
            geometry,
            engine_id=engine_id,
            num_gpu_blocks=_GPU_BLOCKS,
            token_budget=token_budget,
            per_request_tokens=long_prefill_token_threshold,
            step_sleep_s=step_sleep_s,
        )
        self.manager = connector.connector_scheduler.manager
        view = h.primary_view(self.manager)  # the pool's own view, shared with the tiers: keep it
        self.row_bytes = view.strides[0]
        # A flat byte view for the simulated workers; released in shutdown() (a live export keeps
        # the /dev/shm mmap from closing).
        self._flat: memoryview | None = view.cast("B")
        if self.row_bytes != geometry.row_bytes:
            self.shutdown()
            raise AssertionError(f"row is {self.row_bytes} B, geometry says {geometry.row_bytes}")
        ranks = range(geometry.world_size)
        self._pending_stores: list[list[_PendingReport]] = [[] for _ in ranks]  # per rank
        self._held_stores: list[list[int]] = [[] for _ in ranks]  # per rank, in report order
        self._held_ranks: set[int] = set()
        self.store_jobs: list[StoreJob] = []
        self.completion_order: list[int] = []  # store jobs, in the order their last report came
        self._reports_left: dict[int, int] = {}
        self.load_jobs: int = 0

    # -- worker reports ---------------------------------------------------------------------

    def hold_store_reports(self, ranks: Iterable[int] | None = None) -> None:
        """Withhold the store completions of these simulated workers (default: all) from now on,
        until release_store_reports(): a worker whose transfers lag (or, for all ranks, a burst of
        completions arriving together)."""
        self._held_ranks |= set(range(self.geometry.world_size) if ranks is None else ranks)

    def release_store_reports(self, ranks: Iterable[int] | None = None) -> None:
        """At the next step these workers report every withheld store job, in the order they
        finished, together with what is due then. The engine merges the workers' reports the way
        vLLM's KVOutputAggregator does (rank 0's dict first, the others added in rank order), so
        the connector calls complete_store -- and the manager cascades -- job after job in that
        merged order, all in one update_connector_output."""
        self._held_ranks -= set(range(self.geometry.world_size) if ranks is None else ranks)

    def held_store_reports(self) -> int:
        """Store reports not yet made, over all ranks (withheld or not yet due)."""
        return sum(map(len, self._held_stores)) + sum(map(len, self._pending_stores))

    _reports_owed = held_store_reports

    # -- the step loop ----------------------------------------------------------------------

    def run_until_idle(self, timeout_s: float = 60.0, max_steps: int = 20_000) -> int:
        assert not self._held_ranks, "store reports are held: release them first"
        return super().run_until_idle(timeout_s, max_steps)

    def reset_cache(self) -> None:
        """The connector's reset_cache (vLLM's reset_prefix_cache(reset_connector=True)), between
        steps; the primary pool is emptied, tiers keep their contents. Then steps until the
        flushed jobs' reports are in (0.33 holds promotions until then)."""
        assert not self._held_ranks, "store reports are held: release them first"
        assert self.connector.reset_cache() in (True, None)
        self.run_until_idle()  # flushed jobs are reported (stale: ignored; 0.33: the fence)

    def primary_holds(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Whether the primary pool holds each key (readable or being written)."""
        probe = h.ReqContext(req_id="connector-harness-probe")
        with h._manager_lock(self.manager):
            results = [self.manager.primary_tier.lookup(k, probe) for k in keys]
        return [r in (h.LookupResult.HIT, h.LookupResult.HIT_PENDING) for r in results]

    def shutdown(self) -> None:
        """The connector's shutdown (manager and tiers), after dropping this engine's view of the
        primary pool; asserts the /dev/shm region is gone. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._flat is not None:
            self._flat.release()
            self._flat = None
        self.connector.shutdown()
        leftover = h.shm_region_paths(self.engine_id)
        assert not leftover, f"primary region not removed at shutdown: {leftover}"

    # -- the simulated workers (SchedulerStandIn's hook) --------------------------------------

    def _run_workers(self, meta: Any, output: SimpleNamespace, scheduled: dict[str, tuple[int, int]]) -> WorkerReport:
        """Apply the step's jobs to the primary rows; loads are done in the step they ran."""
        load_job_of = {}
        for job_id, job in meta.load_jobs.items():
            self._load(job)
            self.load_jobs += 1
            load_job_of[job.req_id] = job_id
        for job_id, job in meta.store_jobs.items():
            self._reports_left[job_id] = self.geometry.world_size
            self._store(job_id, job)
            for rank_pending in self._pending_stores:
                rank_pending.append(_PendingReport(job_id, self.step_count + self.store_report_delay_steps))
        completed = self._due_reports(meta)
        for rank_jobs in completed:  # a load is reported by every rank in the step it ran
            rank_jobs.extend(load_job_of[req_id] for req_id in sorted(load_job_of))
        return WorkerReport(set(load_job_of), set(), self._merge_reports(completed))

    def _chunks_of(self, gpu_spec: Any, num_rows: int) -> tuple[EngineRequest, list[int]]:
        """The request and chunk index of each of ``num_rows`` chunks a GPU spec covers."""
        bpc = self.geometry.blocks_per_chunk
        block_ids = [int(b) for b in gpu_spec.block_ids]
        assert len(block_ids) == num_rows * bpc, f"{len(block_ids)} GPU blocks for {num_rows} rows of {bpc} blocks"
        owners = [self.block_owner[b] for b in block_ids]
        req = owners[0][0]
        chunks = []
        for row in range(num_rows):
            group = owners[row * bpc : (row + 1) * bpc]
            idx = [i for r, i in group]
            assert all(r is req for r, _ in group), "a chunk spans two requests"
            assert idx == list(range(idx[0], idx[0] + bpc)) and idx[0] % bpc == 0, (
                f"GPU blocks {idx} are not one aligned chunk"
            )
            chunks.append(idx[0] // bpc)
        assert isinstance(req, EngineRequest)
        return req, chunks

    def _store(self, job_id: int, job: Any) -> None:
        rows = h.row_ids(job.dst_spec)
        req, chunks = self._chunks_of(job.src_spec, len(rows))
        keys = req.chunk_keys(max(chunks) + 1)
        for row, chunk in zip(rows, chunks):
            self._write_row(row, h.payload_for(keys[chunk], self.row_bytes))
        req.stored_chunks.extend(chunks)
        # The connector's own record of the job: the keys complete_store will get, as a set.
        index = {k: c for c, k in enumerate(keys)}
        job_keys = self.connector.connector_scheduler._jobs[job_id].keys
        record = StoreJob(job_id, req.request_id, self.step_count, chunks, [index[k] for k in job_keys])
        assert sorted(record.key_order) == sorted(chunks), "job keys differ from its rows"
        req.store_jobs.append(record)
        self.store_jobs.append(record)

    def _load(self, job: Any) -> None:
        rows = h.row_ids(job.src_spec)
        req, chunks = self._chunks_of(job.dst_spec, len(rows))
        keys = req.chunk_keys(max(chunks) + 1)
        for row, chunk in zip(rows, chunks):
            got = self._read_row(row)
            assert got == h.payload_for(keys[chunk], self.row_bytes), (
                f"{req.request_id}: chunk {chunk} loaded from row {row} differs from what was stored"
            )
        req.loaded_chunks.extend(chunks)

    def _due_reports(self, meta: Any) -> list[list[int]]:
        """Per rank, the store jobs its worker reports this step: those due (none while the rank
        is held), earlier withheld ones first, plus every job the connector asked to flush (the
        worker waits for those)."""
        flush = set(meta.jobs_to_flush or ())
        reports = []
        for rank in range(self.geometry.world_size):
            due, later = [], []
            for p in self._pending_stores[rank]:
                (due if p.due_step <= self.step_count or p.job_id in flush else later).append(p)
            self._pending_stores[rank] = later
            due_ids = [p.job_id for p in due]
            if rank in self._held_ranks:
                self._held_stores[rank].extend(j for j in due_ids if j not in flush)
                reports.append([j for j in due_ids if j in flush])
            else:
                reports.append(self._held_stores[rank] + due_ids)
                self._held_stores[rank] = []
        return reports

    def _merge_reports(self, completed: list[list[int]]) -> OffloadingWorkerMetadata | None:
        """Each rank's OffloadingWorkerMetadata, merged like KVOutputAggregator (the first rank
        with a report is the accumulator, the others are aggregate()d into it in rank order)."""
        meta = None
        for rank_jobs in completed:
            if not rank_jobs:
                continue
            worker = OffloadingWorkerMetadata(completed_jobs={j: 1 for j in rank_jobs})
            meta = worker if meta is None else meta.aggregate(worker)
        for job_id, count in meta.completed_jobs.items() if meta else ():  # the connector's order
            if job_id in self._reports_left:
                self._reports_left[job_id] -= count
                if not self._reports_left[job_id]:
                    del self._reports_left[job_id]
                    self.completion_order.append(job_id)
        return meta

    def _write_row(self, row: int, data: bytes) -> None:
        assert self._flat is not None, "engine is shut down"
        self._flat[row * self.row_bytes : (row + 1) * self.row_bytes] = data

    def _read_row(self, row: int) -> bytes:
        assert self._flat is not None, "engine is shut down"
        return bytes(self._flat[row * self.row_bytes : (row + 1) * self.row_bytes])


# GPU blocks of the simulated KV cache. Only arithmetic on the scheduler side (bytes per block
# = tensor size // num_blocks); block ids are handed out fresh and never reach this bound.
_GPU_BLOCKS = 1 << 16
