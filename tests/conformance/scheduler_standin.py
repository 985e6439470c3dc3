"""The conformance harnesses' one stand-in for vLLM's scheduler loop (vllm/v1/core/sched/scheduler.py).

``SchedulerStandIn`` drives vLLM's real ``OffloadingConnector`` (scheduler role) the way the engine
core does, step by step. The two harnesses built on it differ only in their workers, which they
supply through the hooks below: connector_harness.ConnectorEngine (tier mode: simulated workers
write and read the CPU pool's primary rows) and direct_harness.DirectEngine (direct mode: real
worker-side connectors, one per TP rank, over CPU KV caches).

What the stand-in simulates:

* a FIFO waiting queue; running requests first, then waiting ones, under a token budget per step
  (chunked prefill) and an optional cap on one request's tokens per step (vLLM's
  ``long_prefill_token_threshold``);
* ``get_num_new_matched_tokens`` for waiting requests with nothing computed (``None`` = ask
  again next step); ``before_alloc(engine, request, matched_tokens)`` runs after a lookup matched
  and before ``update_state_after_alloc``, i.e. before the connector commits to the load;
* GPU blocks handed out with fresh ids (``block_owner`` maps each live one to its request and
  index), no GPU prefix cache;
* an async load parks the request in ``WAITING_FOR_REMOTE_KVS`` until the workers report it in
  ``finished_recving``; a load they report failed (``failed_recving``, 0.34+) is handled as
  vLLM's scheduler does under ``kv_load_failure_policy`` ("recompute": computed again from token 0
  on fresh blocks; "fail": finished with FINISHED_ERROR); a whole-prompt hit recomputes its last
  token;
* every request is prefill plus ``max_tokens`` output tokens, then finished
  (``request_finished_all_groups``), and its id goes into the next step's ``finished_req_ids``.
  No preemption, one KV cache group;
* block hashes: one 32-byte hash per hash block, chained sha256 over a prompt tag and the block
  index; two requests with the same tag share a prefix the way two identical prompts do.

The interface an engine supplies:

* ``_run_workers(meta, output, scheduled) -> WorkerReport``: the workers' part of the step, after
  ``build_connector_meta``; ``scheduled`` maps each scheduled request to (first token, tokens) of
  this step's forward pass;
* ``_loaded(request)``: a finished load, before the request is scheduled again (default: nothing);
* ``_reports_owed()``: worker reports not yet made, which run_until_idle waits for (default: 0);
* ``shutdown()``, which sets ``_closed`` (the stand-in is a context manager that calls it).

Every loop is bounded twice, by a step count and by wall time (TimeoutError names what is left).
The engine is driven from the test's thread; vLLM's and MemKV's threads run underneath, and each
step ends with ``step_sleep_s`` (the "model execution" window in which they run). Every step ends
with ``build_connector_meta`` and calls no other connector hook inside a step: the 0.33 connector
holds ``manager.lock`` from ``get_num_new_matched_tokens`` until then.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any

from typing_extensions import Self
from vllm.v1.kv_offload.base import OffloadKey, make_offload_key
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from tests.conformance import harness_compat


def block_hash(tag: str, index: int, parent: bytes | None) -> bytes:
    """Hash block ``index`` of prompt ``tag``, chained on its parent like vLLM's block hasher."""
    return hashlib.sha256((parent or b"") + f"{tag}/{index}".encode()).digest()


def chain_hashes(tag: str, n: int, start: Sequence[bytes] = ()) -> list[bytes]:
    """The first ``n`` block hashes of prompt ``tag``, extending those already in ``start``."""
    hashes = list(start)
    while len(hashes) < n:
        hashes.append(block_hash(tag, len(hashes), hashes[-1] if hashes else None))
    return hashes


def prompt_keys(tag: str, num_chunks: int, geometry: Any) -> list[OffloadKey]:
    """The offload keys of the first ``num_chunks`` chunks of prompt ``tag``, in prompt order:
    chunk c is keyed by the hash of its last hash block (the connector's update_offload_keys).
    ``geometry`` is either harness's (tokens per hash block == gpu_block_size)."""
    per = geometry.blocks_per_chunk
    hashes = chain_hashes(tag, num_chunks * per)
    return [make_offload_key(hashes[(c + 1) * per - 1], 0) for c in range(num_chunks)]


def vllm_config(
    extra_config: dict[str, Any],
    geometry: Any,
    engine_id: str,
    *,
    model: str,
    dtype: str,
    num_kv_heads: int,
    rank: int = 0,
) -> SimpleNamespace:
    """A duck-typed VllmConfig: every attribute the connector (either role), its spec, the tiers
    and the direct worker read on 0.25-0.34 (vllm-connector-api.md section 1); a real one needs
    a model."""
    parallel = {"tensor_parallel_size": geometry.world_size, "pipeline_parallel_size": 1}
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size", "data_parallel_size"):
        parallel[name] = 1
    return SimpleNamespace(
        **harness_compat.vllm_config_fields(),
        instance_id=engine_id,
        use_v2_model_runner=False,
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra_config, engine_id=engine_id),
        kv_events_config=None,
        speculative_config=None,
        attention_config=SimpleNamespace(hisparse_config=None),  # 0.33
        model_config=SimpleNamespace(
            model=model, dtype=dtype, max_model_len=1 << 20, use_mla=False, get_total_num_kv_heads=lambda: num_kv_heads
        ),
        cache_config=SimpleNamespace(
            block_size=geometry.gpu_block_size,
            cache_dtype="auto",
            enable_prefix_caching=True,
            **dict.fromkeys(
                ("hash_block_size", "prefix_match_unit", "kv_cache_layout", "prefix_cache_retention_interval")
            ),
        ),
        parallel_config=SimpleNamespace(
            **parallel,
            world_size=geometry.world_size,
            rank=rank,
            data_parallel_rank=0,
            data_parallel_rank_local=None,
            data_parallel_index=0,
            distributed_executor_backend=None,
            nnodes_within_dp=1,
            cp_kv_cache_interleave_size=1,
        ),
    )


class StandInRequest:
    """A request as the connector sees it (the fields of vllm.v1.request.Request it reads), plus
    what the stand-in recorded about it."""

    def __init__(
        self,
        req_id: str,
        tag: str,
        num_prompt_tokens: int,
        max_tokens: int,
        geometry: Any,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
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
        # -- the stand-in's own ------------------------------------------------------------
        self.tag = tag
        self.max_tokens = max_tokens
        self.num_output_tokens = 0
        self.block_ids: list[int] = []  # GPU blocks, in token order
        self.geometry = geometry
        self._extend_hashes()
        # -- outcomes ----------------------------------------------------------------------
        self.matched_tokens: int | None = None  # the connector's first definite answer
        self.deferred_lookups = 0  # None answers before it
        self.loaded_blocks = 0  # GPU blocks the async load covers (0 again if it failed)
        self.failed_block_ids: list[int] = []  # the GPU blocks of a load that failed
        self.finished_step: int | None = None

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def num_full_chunks(self) -> int:
        """Chunks of the prompt that are complete, i.e. the most a lookup can ever match."""
        return self.num_prompt_tokens // self.geometry.block_size

    def chunk_keys(self, num_chunks: int | None = None) -> list[OffloadKey]:
        """Offload keys of the prompt's complete chunks (or of the first ``num_chunks``)."""
        return prompt_keys(self.tag, self.num_full_chunks if num_chunks is None else num_chunks, self.geometry)

    def _extend_hashes(self) -> None:
        """One hash per complete hash block of the tokens so far (prompt and output)."""
        self.block_hashes = chain_hashes(self.tag, self.num_tokens // self.geometry.gpu_block_size, self.block_hashes)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.request_id}, {self.status.name}, computed "
            f"{self.num_computed_tokens}/{self.num_tokens})"
        )


@dataclasses.dataclass
class WorkerReport:
    """What the workers report for one step, merged over ranks as vLLM's KVOutputAggregator does."""

    finished_recving: set[str]  # loads every rank finished
    failed_recving: set[str]  # of those, loads some rank reported failed (0.34+)
    worker_meta: Any  # the merged kv_connector_worker_meta, or None


class SchedulerStandIn:
    """vLLM's scheduler loop around a real scheduler-role ``OffloadingConnector`` (module docstring).

    ``token_budget`` is max_num_batched_tokens: a prompt longer than that is prefilled in several
    steps; ``per_request_tokens`` caps one request's tokens per step (default: the budget)."""

    request_type: type[StandInRequest] = StandInRequest
    _closed: bool

    def __init__(
        self,
        connector: Any,
        geometry: Any,
        *,
        engine_id: str,
        num_gpu_blocks: int,
        token_budget: int = 2048,
        per_request_tokens: int | None = None,
        step_sleep_s: float = 0.002,
        before_alloc: Callable[[Any, StandInRequest, int], None] | None = None,
        load_failure_policy: str = "recompute",
    ) -> None:
        if token_budget < 1:
            raise ValueError("token_budget must be >= 1")
        self.connector = connector
        self.geometry = geometry
        self.engine_id = engine_id
        self.num_gpu_blocks = num_gpu_blocks
        self.token_budget = token_budget
        self.per_request_tokens = per_request_tokens or token_budget
        self.step_sleep_s = step_sleep_s
        self.before_alloc = before_alloc
        self.load_failure_policy = load_failure_policy
        self.step_count = 0
        self.requests: dict[str, StandInRequest] = {}  # live (not yet finished) requests
        self.finished: dict[str, StandInRequest] = {}
        self.failed_loads: list[str] = []  # request ids whose load failed
        self.block_owner: dict[int, tuple[StandInRequest, int]] = {}  # live GPU block -> (request, index)
        self.stats: Counter[tuple[str, tuple]] = Counter()  # every counter series, summed over steps
        self.gauges: dict[tuple[str, tuple], float] = {}  # every gauge series, its last value
        self._waiting: list[StandInRequest] = []
        self._running: list[StandInRequest] = []
        self._finished_ids: set[str] = set()  # finished last step: next step's finished_req_ids
        self._next_block_id = itertools.count(1)  # 0 is the null block
        self._req_seq = itertools.count()

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        tag: str,
        num_prompt_tokens: int,
        max_tokens: int = 1,
        *,
        req_id: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> Any:
        """A new request for prompt ``tag`` (same tag, same tokens): the engine's add_request."""
        req = self.request_type(
            req_id or f"{self.engine_id}-req-{next(self._req_seq)}",
            tag,
            num_prompt_tokens,
            max_tokens,
            self.geometry,
            kv_transfer_params,
        )
        self.connector.on_new_request(req)
        self.requests[req.request_id] = req
        self._waiting.append(req)
        return req

    # -- the step loop ----------------------------------------------------------------------

    def step(self) -> Any:
        """One engine step: schedule (lookups, allocation), build_connector_meta, the workers'
        part, then outputs (finished requests, update_connector_output, stats and events, loads
        done). Returns the step's connector metadata."""
        assert not self._closed, "engine is shut down"
        self.step_count += 1
        output = self._schedule()
        meta = self.connector.build_connector_meta(output)
        scheduled = {}
        for req_id, n in output.num_scheduled_tokens.items():  # _update_after_schedule
            req = self.requests[req_id]
            scheduled[req_id] = (req.num_computed_tokens, n)
            req.num_computed_tokens += n
        report = self._run_workers(meta, output, scheduled)
        self._finished_ids = self._sample(output)
        kv_output: dict[str, Any] = {
            "finished_recving": set(report.finished_recving) or None,
            "kv_connector_worker_meta": report.worker_meta,
        }
        if report.failed_recving:  # 0.34+ only: older releases have no such field
            kv_output["failed_recving"] = set(report.failed_recving)
        self.connector.update_connector_output(KVConnectorOutput(**kv_output))
        self._collect_stats()
        list(self.connector.take_events())
        for req_id in report.finished_recving:
            req = self.requests[req_id]
            assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, req
            if req_id in report.failed_recving:
                self._load_failed(req)
                continue
            self._loaded(req)
            req.status = RequestStatus.WAITING
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        return meta

    def run_until(
        self,
        done: Callable[[], bool],
        timeout_s: float = 30.0,
        what: str | Callable[[], str] = "",
        max_steps: int = 20_000,
    ) -> int:
        """Step until ``done()``; returns the steps taken. TimeoutError (naming ``what``, or what
        it returns) after ``max_steps`` steps or ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        steps = 0
        for steps in range(max_steps):
            if done():
                return steps
            if time.monotonic() >= deadline:
                break
            self.step()
        if done():
            return max_steps
        raise TimeoutError(f"not done after {steps + 1} steps / {timeout_s} s: {what() if callable(what) else what}")

    def run_until_finished(
        self, reqs: Iterable[StandInRequest], timeout_s: float = 60.0, max_steps: int = 20_000
    ) -> int:
        """Step until every request in ``reqs`` finished; returns the steps taken."""
        reqs = list(reqs)
        return self.run_until(
            lambda: all(r.is_finished() for r in reqs),
            timeout_s,
            lambda: f"unfinished: {[r for r in reqs if not r.is_finished()]}",
            max_steps,
        )

    def run_until_idle(self, timeout_s: float = 60.0, max_steps: int = 20_000) -> int:
        """Step until no request is live, the workers owe no report and the connector has no
        pending push work (its jobs, the manager's cascades and promotions)."""

        def idle() -> bool:
            return not self.requests and not self._reports_owed() and not self.connector.has_pending_push_work()

        def what() -> str:
            return (
                f"live {list(self.requests.values())}, reports owed {self._reports_owed()}, "
                f"pending push work {self.connector.has_pending_push_work()}"
            )

        return self.run_until(idle, timeout_s, what, max_steps)

    def run(self, tag: str, num_prompt_tokens: int, timeout_s: float = 60.0, **request: Any) -> Any:
        """One request from arrival to finish, then until the engine is idle (stores done)."""
        req = self.add_request(tag, num_prompt_tokens, **request)
        self.run_until(req.is_finished, timeout_s, lambda: f"{req} not finished")
        self.run_until_idle(timeout_s)
        return req

    def stat(self, name: str, labels: tuple = ()) -> float:
        """A counter's sum over every step so far (e.g. vllm:kv_offload_memkv_sheds)."""
        return self.stats.get((name, labels), 0)

    # -- the interface an engine supplies ----------------------------------------------------

    def _run_workers(self, meta: Any, output: SimpleNamespace, scheduled: dict[str, tuple[int, int]]) -> WorkerReport:
        raise NotImplementedError

    def _loaded(self, req: StandInRequest) -> None:
        """A load finished on every rank; the request is scheduled again next."""

    def _reports_owed(self) -> int:
        """Worker reports not yet made (run_until_idle waits for them)."""
        return 0

    def shutdown(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- internals ---------------------------------------------------------------------------

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
                matched, load_async = self.connector.get_num_new_matched_tokens(req, 0)
                if matched is None:
                    req.deferred_lookups += 1
                    still_waiting.append(req)
                    continue
                if req.matched_tokens is None:
                    req.matched_tokens = matched
                assert load_async or not matched, "0.33 sync loads are not simulated"
                if matched and self.before_alloc is not None:
                    self.before_alloc(self, req, matched)
                if load_async:  # parked until finished_recving
                    self._allocate(req, matched)
                    self.connector.update_state_after_alloc(req, self._blocks(req), matched)
                    req.num_computed_tokens = matched
                    req.loaded_blocks = matched // self.geometry.gpu_block_size
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
            self._running.append(req)
            new_reqs.append(SimpleNamespace(req_id=req.request_id, block_ids=(list(req.block_ids),)))
            num_scheduled[req.request_id] = n
            budget -= n
        self._waiting = still_waiting
        return SimpleNamespace(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=cached_ids, new_block_ids=cached_blocks, resumed_req_ids=set()
            ),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            preempted_req_ids=set(),
            finished_req_ids=set(self._finished_ids),
            partial_tail_offloads={},  # 0.28: hybrid Mamba models only
            kv_connector_block_state=None,  # 0.29+
            kv_cache_block_copies=None,  # 0.29+
        )

    def _allocate(self, req: StandInRequest, upto_tokens: int) -> list[int]:
        """GPU blocks so that ``req`` covers ``upto_tokens``; returns the new block ids."""
        need = -(-upto_tokens // self.geometry.gpu_block_size) - len(req.block_ids)
        new = []
        for _ in range(max(0, need)):
            block_id = next(self._next_block_id)
            assert block_id < self.num_gpu_blocks, "the simulated GPU ran out of blocks: raise num_gpu_blocks"
            self.block_owner[block_id] = (req, len(req.block_ids))
            req.block_ids.append(block_id)
            new.append(block_id)
        return new

    def _free_blocks(self, req: StandInRequest) -> None:
        for block_id in req.block_ids:
            del self.block_owner[block_id]

    @staticmethod
    def _blocks(req: StandInRequest) -> SimpleNamespace:
        """KVCacheBlocks as update_state_after_alloc reads them: fresh blocks, no hash."""
        blocks = [SimpleNamespace(block_id=b, is_null=False, block_hash=None) for b in req.block_ids]
        return SimpleNamespace(blocks=(blocks,))

    def _sample(self, output: SimpleNamespace) -> set[str]:
        """Model output: a request whose prompt is computed gets one token per step until
        max_tokens; then it finishes. Returns the ids finished this step."""
        finished = set()
        for req_id in output.num_scheduled_tokens:
            req = self.requests[req_id]
            if req.num_computed_tokens < req.num_tokens:
                continue  # a partial prefill step samples nothing
            req.num_tokens += 1
            req.num_output_tokens += 1
            req._extend_hashes()
            if req.num_output_tokens >= req.max_tokens:
                self._running.remove(req)
                self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
                finished.add(req_id)
        return finished

    def _finish(self, req: StandInRequest, status: RequestStatus) -> None:
        """The request ends: the connector's request_finished, its GPU blocks freed."""
        req.status = status
        req.finished_step = self.step_count
        self.connector.request_finished_all_groups(req, (list(req.block_ids),))
        self._free_blocks(req)
        self.finished[req.request_id] = self.requests.pop(req.request_id)

    def _load_failed(self, req: StandInRequest) -> None:
        """vLLM's Scheduler._handle_failed_recving and _update_waiting_for_remote_kvs (0.34)."""
        self.failed_loads.append(req.request_id)
        req.loaded_blocks = 0
        req.failed_block_ids = list(req.block_ids)  # never handed out again: tests check them after
        if self.load_failure_policy == "recompute":  # nothing computed: blocks freed, the request waits
            self._free_blocks(req)
            req.num_computed_tokens = 0
            req.block_ids = []
            req.status = RequestStatus.WAITING
            return
        self._waiting.remove(req)
        self._finish(req, RequestStatus.FINISHED_ERROR)

    def _collect_stats(self) -> None:
        """The connector's stats of this step: counters summed (a list counts its entries),
        gauges kept at their last value."""
        stats = self.connector.get_kv_connector_stats()
        if stats is None:
            return
        types = stats.data.get("types", {})
        for name, series in stats.data.get("data", {}).items():
            for labels, value in series.items():
                if "gauge" in str(types.get(name, "")).lower():
                    self.gauges[(name, labels)] = value
                else:
                    self.stats[(name, labels)] += len(value) if isinstance(value, list) else value
