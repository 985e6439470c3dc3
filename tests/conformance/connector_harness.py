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
* Simulated, the engine (a small stand-in for ``vllm/v1/core/sched/scheduler.py``): a FIFO
  waiting queue; running requests first, then waiting ones, under a token budget per step
  (chunked prefill); ``get_num_new_matched_tokens`` for waiting requests with nothing computed
  (``None`` = ask again next step); GPU blocks handed out with fresh ids and no GPU prefix cache;
  an async load parks the request in ``WAITING_FOR_REMOTE_KVS`` until ``finished_recving``, and a
  whole-prompt hit recomputes its last token; every request is prefill plus ``max_tokens``
  output tokens, then finished (``request_finished_all_groups``, and its id in the next step's
  ``finished_req_ids``). No preemption, no decode batching beyond that, one KV cache group.
* Simulated, the ``VllmConfig``: a namespace with the attributes the connector reads
  (vllm-connector-api.md section 1).
* Simulated, the GPU workers: a store job writes each chunk's deterministic bytes
  (``vllm_harness.payload_for`` of the chunk's key) into its destination primary row; a load job
  reads each source row and checks it byte for byte against the bytes of the chunk its GPU
  blocks belong to (AssertionError otherwise). Completions go back the way workers report them,
  ``KVConnectorOutput(kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=...))``,
  one report per simulated worker (``world_size``). Store reports can be deferred by N steps or
  held and released in bulk, so that several store jobs reach the tier in one step.
* Block hashes: one 32-byte hash per hash block, chained sha256 over a prompt tag and the block
  index; two requests with the same tag share a prefix the way two identical prompts do.

Every loop is bounded twice, by a step count and by wall time (TimeoutError names what was
left). The engine is driven from one thread; vLLM's and the tiers' threads run underneath,
and each step ends with a short sleep (the "model execution" window in which they run).

Threading and the 0.33 manager lock: the connector itself opens a step-scoped hold of
``manager.lock`` in ``get_num_new_matched_tokens``/``update_state_after_alloc`` and releases it at
the end of ``build_connector_meta``, so every step here ends with ``build_connector_meta`` and
no other connector hook is called inside a step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from typing_extensions import Self
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import OffloadKey, make_offload_key
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from tests.conformance import harness_compat
from tests.conformance import vllm_harness as h

__all__ = [
    "ConnectorEngine",
    "EngineRequest",
    "StoreJob",
    "prompt_keys",
]

_MODEL_MAX_LEN = 1 << 20
_HASH_BYTES = 32  # what the default sha256 prefix hash yields


def _block_hash(tag: str, index: int, parent: bytes | None) -> bytes:
    """Hash block ``index`` of prompt ``tag``, chained on its parent like vLLM's block hasher."""
    return hashlib.sha256((parent or b"") + f"{tag}/{index}".encode()).digest()[:_HASH_BYTES]


def prompt_keys(tag: str, num_chunks: int, geometry: h.Geometry = h.Geometry()) -> list[OffloadKey]:
    """The offload keys of the first ``num_chunks`` chunks of prompt ``tag``, in prompt order:
    chunk c is keyed by the hash of its last hash block (the connector's update_offload_keys)."""
    hashes = _chain(tag, num_chunks * geometry.blocks_per_chunk)
    per = geometry.blocks_per_chunk  # tokens_per_hash == gpu_block_size here
    return [make_offload_key(hashes[(c + 1) * per - 1], 0) for c in range(num_chunks)]


def _chain(tag: str, n: int, start: Sequence[bytes] = ()) -> list[bytes]:
    hashes = list(start)
    while len(hashes) < n:
        hashes.append(_block_hash(tag, len(hashes), hashes[-1] if hashes else None))
    return hashes


class EngineRequest:
    """A request as the connector sees it (the fields of vllm.v1.request.Request it reads),
    plus what the engine recorded about it."""

    def __init__(self, req_id: str, tag: str, num_prompt_tokens: int, max_tokens: int,
                 geometry: h.Geometry, kv_transfer_params: dict[str, Any] | None) -> None:
        # -- read by the connector --------------------------------------------------------
        self.request_id = req_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = num_prompt_tokens
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.kv_transfer_params = kv_transfer_params
        for name, value in harness_compat.request_fields().items():  # per release
            setattr(self, name, value)
        self.block_hashes: list[bytes] = []
        # -- the engine's own --------------------------------------------------------------
        self.tag = tag
        self.max_tokens = max_tokens
        self.num_output_tokens = 0
        self.block_ids: list[int] = []  # GPU blocks, in token order
        self.scheduled = False  # scheduled at least once since its last (re)start
        self._geometry = geometry
        self._extend_hashes()
        # -- outcomes ----------------------------------------------------------------------
        self.matched_tokens: int | None = None  # the connector's first definite answer
        self.deferred_lookups = 0  # None answers before it
        self.loaded_chunks: list[int] = []  # chunk indices loaded from the primary pool
        self.stored_chunks: list[int] = []  # chunk indices written into primary rows
        self.store_jobs: list[StoreJob] = []
        self.finished_step: int | None = None

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def num_full_chunks(self) -> int:
        """Chunks of the prompt that are complete, i.e. the most a lookup can ever match."""
        return self.num_prompt_tokens // self._geometry.block_size

    def chunk_keys(self, num_chunks: int | None = None) -> list[OffloadKey]:
        """Offload keys of the prompt's complete chunks (or of the first ``num_chunks``)."""
        n = self.num_full_chunks if num_chunks is None else num_chunks
        return prompt_keys(self.tag, n, self._geometry)

    def _extend_hashes(self) -> None:
        """One hash per complete hash block of the tokens so far (prompt and output)."""
        self.block_hashes = _chain(self.tag, self.num_tokens // self._geometry.gpu_block_size,
                                   self.block_hashes)

    def __repr__(self) -> str:
        return (f"EngineRequest({self.request_id}, {self.status.name}, computed "
                f"{self.num_computed_tokens}/{self.num_tokens})")


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


class ConnectorEngine:
    """vLLM's real OffloadingConnector (scheduler role) inside a minimal engine step loop.

    Use as a context manager, or call shutdown(). ``token_budget`` is the scheduler's
    max_num_batched_tokens: a prompt longer than that is prefilled in several steps, and so
    reaches the manager as several store jobs; ``long_prefill_token_threshold`` caps one request's
    tokens per step (vLLM's scheduler key of that name), so that several long prompts prefill side
    by side, each with a store job per step. ``store_report_delay_steps`` is how many steps
    after its submission a store job is reported complete (1: the worker's transfer finished by
    the next step, as vLLM's worker defers stores to the next step's start).
    """

    def __init__(
        self,
        secondary_tiers: Sequence[Mapping[str, Any]],
        geometry: h.Geometry = h.Geometry(),
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
        self.geometry = geometry
        self.token_budget = token_budget
        self.per_request_tokens = long_prefill_token_threshold or token_budget
        self.store_report_delay_steps = store_report_delay_steps
        self.step_sleep_s = step_sleep_s
        self.engine_id = engine_id or f"conn-{uuid.uuid4().hex[:12]}"
        self.config = h.tiering_config(secondary_tiers, geometry, **dict(extra_config or {}))
        self.vllm_config = _vllm_config(self.config, geometry, self.engine_id, model_name)
        self.kv_cache_config = h.build_kv_cache_config(geometry, num_gpu_blocks=_GPU_BLOCKS)
        self.connector = OffloadingConnector(self.vllm_config, KVConnectorRole.SCHEDULER,
                                             self.kv_cache_config)
        self.scheduler = self.connector.connector_scheduler
        self.manager = self.scheduler.manager
        view = h.primary_view(self.manager)  # the pool's own view, shared with the tiers: keep it
        self.row_bytes = view.strides[0]
        # A flat byte view for the simulated workers; released in shutdown() (a live export keeps
        # the /dev/shm mmap from closing).
        self._flat: memoryview | None = view.cast("B")
        if self.row_bytes != geometry.row_bytes:
            self.shutdown()
            raise AssertionError(f"row is {self.row_bytes} B, geometry says {geometry.row_bytes}")
        self.step_count = 0
        self.requests: dict[str, EngineRequest] = {}  # live (not yet finished) requests
        self.finished: dict[str, EngineRequest] = {}
        self._waiting: list[EngineRequest] = []
        self._running: list[EngineRequest] = []
        self._finished_ids: set[str] = set()  # finished last step: next step's finished_req_ids
        self._gpu_block_owner: dict[int, tuple[EngineRequest, int]] = {}
        self._next_block_id = itertools.count(1)  # 0 is the null block
        self._req_seq = itertools.count()
        ranks = range(geometry.world_size)
        self._pending_stores: list[list[_PendingReport]] = [[] for _ in ranks]  # per rank
        self._held_stores: list[list[int]] = [[] for _ in ranks]  # per rank, in report order
        self._held_ranks: set[int] = set()
        self.store_jobs: list[StoreJob] = []
        self.completion_order: list[int] = []  # store jobs, in the order their last report came
        self._reports_left: dict[int, int] = {}
        self.load_jobs: int = 0
        self.stats: Counter[tuple[str, tuple]] = Counter()  # every metric series, summed
        self._closed = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- requests -------------------------------------------------------------------------

    def add_request(self, tag: str, num_prompt_tokens: int, *, max_tokens: int = 1,
                    req_id: str | None = None,
                    kv_transfer_params: dict[str, Any] | None = None) -> EngineRequest:
        """A new request for prompt ``tag`` (same tag, same tokens): the engine's add_request."""
        req = EngineRequest(req_id or f"{self.engine_id}-req-{next(self._req_seq)}", tag,
                            num_prompt_tokens, max_tokens, self.geometry, kv_transfer_params)
        self.connector.on_new_request(req)
        self.requests[req.request_id] = req
        self._waiting.append(req)
        return req

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

    # -- the step loop ----------------------------------------------------------------------

    def step(self) -> Any:
        """One engine step: schedule (lookups, allocation), build_connector_meta, run the
        simulated workers on its jobs, then process outputs (finished requests, then
        update_connector_output, then stats). Returns the step's connector metadata."""
        assert not self._closed, "engine is shut down"
        self.step_count += 1
        output = self._schedule()
        meta = self.connector.build_connector_meta(output)
        for req_id, n in output.num_scheduled_tokens.items():  # _update_after_schedule
            self.requests[req_id].num_computed_tokens += n
        recving = self._run_workers(meta)
        completed = self._due_reports(meta)
        finished_now = self._sample(output)
        for rank_jobs in completed:  # a load is reported by every rank in the step it ran
            rank_jobs.extend(self._load_job_of[req_id] for req_id in sorted(recving))
        self._finished_ids = finished_now
        self._report(completed, recving)
        for req_id in recving:
            req = self.requests[req_id]
            assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            req.status = RequestStatus.WAITING
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        return meta

    def run_until_finished(self, reqs: Iterable[EngineRequest], max_steps: int = 5000,
                           timeout_s: float = 60.0) -> int:
        """Step until every request in ``reqs`` finished; returns the steps taken."""
        reqs = list(reqs)
        return self._run(lambda: all(r.is_finished() for r in reqs), max_steps, timeout_s,
                         lambda: f"unfinished: {[r for r in reqs if not r.is_finished()]}")

    def run_until_idle(self, max_steps: int = 5000, timeout_s: float = 60.0) -> int:
        """Step until no request is live, no worker report is due or held, and the connector
        has no pending push work (its jobs, the manager's cascades and promotions)."""
        assert not self._held_ranks, "store reports are held: release them first"
        return self._run(self._idle, max_steps, timeout_s,
                         lambda: (f"live {list(self.requests.values())}, reports due "
                                  f"{self.held_store_reports()}, pending push work "
                                  f"{self.connector.has_pending_push_work()}"))

    def prefill(self, tag: str, num_prompt_tokens: int, **kwargs: Any) -> EngineRequest:
        """add_request, then step until it finished and the engine is idle (cascades done)."""
        req = self.add_request(tag, num_prompt_tokens, **kwargs)
        self.run_until_finished([req])
        self.run_until_idle()
        return req

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

    # -- internals: scheduling ----------------------------------------------------------------

    _load_job_of: dict[str, int]

    def _schedule(self) -> SimpleNamespace:
        budget = self.token_budget
        new_reqs, cached_ids, cached_blocks = [], [], []
        num_scheduled: dict[str, int] = {}
        for req in self._running:  # running requests first
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.per_request_tokens)
            if n <= 0:
                continue
            cached_ids.append(req.request_id)
            cached_blocks.append((self._allocate(req, req.num_computed_tokens + n),))
            num_scheduled[req.request_id] = n
            budget -= n
        still_waiting = []
        for req in self._waiting:
            if budget <= 0 or req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                still_waiting.append(req)
                continue
            fresh = req.num_computed_tokens == 0
            if fresh:
                matched, load_async = self._ask_connector(req)
                if matched is None:
                    still_waiting.append(req)
                    continue
                assert load_async or not matched, "0.33 sync loads are not simulated"
                if load_async:  # the engine parks it until finished_recving
                    self._allocate(req, matched)
                    self.connector.update_state_after_alloc(req, self._blocks(req), matched)
                    req.num_computed_tokens = matched
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    still_waiting.append(req)
                    continue
            elif req.num_computed_tokens >= req.num_tokens:  # whole-prompt hit: recompute one
                req.num_computed_tokens = req.num_tokens - 1
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.per_request_tokens)
            self._allocate(req, req.num_computed_tokens + n)
            if fresh:
                self.connector.update_state_after_alloc(req, self._blocks(req), 0)
            req.status = RequestStatus.RUNNING
            req.scheduled = True
            self._running.append(req)
            new_reqs.append(SimpleNamespace(req_id=req.request_id, block_ids=(list(req.block_ids),)))
            num_scheduled[req.request_id] = n
            budget -= n
        self._waiting = still_waiting
        return SimpleNamespace(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=SimpleNamespace(req_ids=cached_ids, new_block_ids=cached_blocks,
                                                  resumed_req_ids=set()),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            preempted_req_ids=set(),
            finished_req_ids=set(self._finished_ids),
            partial_tail_offloads={},  # 0.28: hybrid Mamba models only
            kv_connector_block_state=None,  # 0.29+
            kv_cache_block_copies=None,  # 0.29+
        )

    def _ask_connector(self, req: EngineRequest) -> tuple[int | None, bool]:
        matched, load_async = self.connector.get_num_new_matched_tokens(req, 0)
        if matched is None:
            req.deferred_lookups += 1
        elif req.matched_tokens is None:
            req.matched_tokens = matched
        return matched, load_async

    def _allocate(self, req: EngineRequest, upto_tokens: int) -> list[int]:
        """GPU blocks so that ``req`` covers ``upto_tokens``; returns the new block ids."""
        need = -(-upto_tokens // self.geometry.gpu_block_size) - len(req.block_ids)
        new = []
        for _ in range(max(0, need)):
            block_id = next(self._next_block_id)
            self._gpu_block_owner[block_id] = (req, len(req.block_ids))
            req.block_ids.append(block_id)
            new.append(block_id)
        return new

    def _blocks(self, req: EngineRequest) -> SimpleNamespace:
        """KVCacheBlocks as update_state_after_alloc reads them: fresh blocks, no hash."""
        return SimpleNamespace(blocks=([SimpleNamespace(block_id=b, is_null=False, block_hash=None)
                                        for b in req.block_ids],))

    def _sample(self, output: SimpleNamespace) -> set[str]:
        """Model output: a request whose prompt is computed gets one token per step until
        max_tokens; then it finishes (request_finished_all_groups, GPU blocks freed)."""
        finished = set()
        for req_id in output.num_scheduled_tokens:
            req = self.requests[req_id]
            if req.num_computed_tokens < req.num_tokens:
                continue  # a partial prefill step samples nothing
            req.num_tokens += 1
            req.num_output_tokens += 1
            req._extend_hashes()
            if req.num_output_tokens >= req.max_tokens:
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                req.finished_step = self.step_count
                self._running.remove(req)
                finish = getattr(self.connector, "request_finished_all_groups", None)
                if finish is not None:
                    finish(req, (list(req.block_ids),))
                else:
                    self.connector.request_finished(req, list(req.block_ids))
                for block_id in req.block_ids:
                    del self._gpu_block_owner[block_id]
                finished.add(req_id)
                self.finished[req_id] = self.requests.pop(req_id)
        return finished

    # -- internals: the simulated workers ---------------------------------------------------

    def _run_workers(self, meta: Any) -> set[str]:
        """Apply the step's jobs to the primary rows; returns the requests whose load is done."""
        self._load_job_of = {}
        for job_id, job in meta.load_jobs.items():
            self._load(job)
            self.load_jobs += 1
            self._load_job_of[job.req_id] = job_id
        for job_id, job in meta.store_jobs.items():
            self._reports_left[job_id] = self.geometry.world_size
            self._store(job_id, job)
            for rank_pending in self._pending_stores:
                rank_pending.append(
                    _PendingReport(job_id, self.step_count + self.store_report_delay_steps))
        return set(self._load_job_of)

    def _chunks_of(self, gpu_spec: Any, num_rows: int) -> tuple[EngineRequest, list[int]]:
        """The request and chunk index of each of ``num_rows`` chunks a GPU spec covers."""
        bpc = self.geometry.blocks_per_chunk
        block_ids = [int(b) for b in gpu_spec.block_ids]
        assert len(block_ids) == num_rows * bpc, (
            f"{len(block_ids)} GPU blocks for {num_rows} rows of {bpc} blocks")
        owners = [self._gpu_block_owner[b] for b in block_ids]
        req = owners[0][0]
        chunks = []
        for row in range(num_rows):
            group = owners[row * bpc:(row + 1) * bpc]
            idx = [i for r, i in group]
            assert all(r is req for r, _ in group), "a chunk spans two requests"
            assert idx == list(range(idx[0], idx[0] + bpc)) and idx[0] % bpc == 0, (
                f"GPU blocks {idx} are not one aligned chunk")
            chunks.append(idx[0] // bpc)
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
        record = StoreJob(job_id, req.request_id, self.step_count, chunks,
                          [index[k] for k in self.scheduler._jobs[job_id].keys])
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
                f"{req.request_id}: chunk {chunk} loaded from row {row} differs from what was stored")
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

    def _report(self, completed: list[list[int]], recving: set[str]) -> None:
        """update_connector_output as the engine calls it: each rank's OffloadingWorkerMetadata,
        merged like KVOutputAggregator (the first rank with a report is the accumulator, the
        others are aggregate()d into it in rank order); then the step's stats and events."""
        meta = None
        for rank_jobs in completed:
            if not rank_jobs:
                continue
            worker = OffloadingWorkerMetadata(completed_jobs={j: 1 for j in rank_jobs})
            meta = worker if meta is None else meta.aggregate(worker)
        for job_id, count in (meta.completed_jobs.items() if meta else ()):  # the connector's order
            if job_id in self._reports_left:
                self._reports_left[job_id] -= count
                if not self._reports_left[job_id]:
                    del self._reports_left[job_id]
                    self.completion_order.append(job_id)
        self.connector.update_connector_output(
            KVConnectorOutput(finished_recving=set(recving) or None, kv_connector_worker_meta=meta))
        for name, series in h.stats_values(self.connector.get_kv_connector_stats()).items():
            for labels, value in series.items():
                self.stats[(name, labels)] += len(value) if isinstance(value, list) else value
        list(self.connector.take_events())

    def _idle(self) -> bool:
        return (not self.requests and not self.held_store_reports()
                and not self.connector.has_pending_push_work())

    def _run(self, done, max_steps: int, timeout_s: float, describe) -> int:
        deadline = time.monotonic() + timeout_s
        for steps in range(max_steps):
            if done():
                return steps
            if time.monotonic() >= deadline:
                break
            self.step()
        if done():
            return max_steps
        raise TimeoutError(f"not done after {steps + 1} steps / {timeout_s} s: {describe()}")

    def _write_row(self, row: int, data: bytes) -> None:
        assert self._flat is not None, "engine is shut down"
        self._flat[row * self.row_bytes:(row + 1) * self.row_bytes] = data

    def _read_row(self, row: int) -> bytes:
        assert self._flat is not None, "engine is shut down"
        return bytes(self._flat[row * self.row_bytes:(row + 1) * self.row_bytes])

    def stat(self, name: str, labels: tuple = ()) -> float:
        """A metric's sum over every step so far (e.g. vllm:kv_offload_memkv_sheds)."""
        return self.stats.get((name, labels), 0)


# GPU blocks of the simulated KV cache. Only arithmetic on the scheduler side (bytes per block
# = tensor size // num_blocks); block ids are handed out fresh and never reach this bound.
_GPU_BLOCKS = 1 << 16


def _vllm_config(extra_config: dict[str, Any], geometry: h.Geometry, engine_id: str,
                 model_name: str) -> SimpleNamespace:
    """A duck-typed VllmConfig: every attribute the connector, its spec and the tiers read on
    0.25-0.33 (vllm-connector-api.md section 1); a real one needs a model."""
    return SimpleNamespace(
        instance_id=engine_id,
        use_v2_model_runner=False,
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra_config,
                                           engine_id=engine_id),
        kv_events_config=None,
        speculative_config=None,
        attention_config=SimpleNamespace(hisparse_config=None),  # 0.33
        **harness_compat.vllm_config_fields(),
        model_config=SimpleNamespace(
            model=model_name, dtype="bfloat16", max_model_len=_MODEL_MAX_LEN, use_mla=False,
            get_total_num_kv_heads=lambda: 1,
        ),
        cache_config=SimpleNamespace(
            block_size=geometry.gpu_block_size, cache_dtype="auto", enable_prefix_caching=True,
            hash_block_size=None, prefix_match_unit=None, kv_cache_layout=None,
            prefix_cache_retention_interval=None,
        ),
        parallel_config=SimpleNamespace(
            world_size=geometry.world_size, rank=0, tensor_parallel_size=geometry.world_size,
            pipeline_parallel_size=1, prefill_context_parallel_size=1,
            decode_context_parallel_size=1, data_parallel_size=1, data_parallel_rank=0,
            data_parallel_rank_local=None, data_parallel_index=0,
            distributed_executor_backend=None, nnodes_within_dp=1,
        ),
    )
