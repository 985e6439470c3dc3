"""Headless engine for direct mode: vLLM's real OffloadingConnector, scheduler AND worker side.

What is real:

* ``OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)`` with its
  ``OffloadingConnectorScheduler`` and the spec the wrapper builds from
  ``kv_connector_extra_config`` (``spec_name: MemKVOffloadingSpec``, ``spec_module_path:
  memkv_vllm.direct``), i.e. our manager, as the engine core has it;
* one ``OffloadingConnector(..., KVConnectorRole.WORKER, ...)`` per simulated TP rank, each with
  its own spec instance and its own KV cache registered through the real
  ``register_kv_caches`` (so ``get_worker`` receives vLLM's own CanonicalKVCaches), driven
  through the wrapper's worker API in the engine's order: ``bind_connector_metadata``,
  ``handle_preemptions``, ``start_load_kv``, (forward pass), ``wait_for_save``,
  ``get_finished``, ``build_connector_worker_meta``, ``clear_connector_metadata``;
* the connector metadata is pickled to each worker, as the engine ships it;
* a real ``KVCacheConfig`` (``NUM_LAYERS`` full-attention layers, one group) and real
  ``RequestStatus`` values; ``KVConnectorOutput`` / ``OffloadingWorkerMetadata``.

What is simulated (boundaries we do not own):

* CUDA: each rank's KV cache is a CPU float16 tensor per layer, ``(num_blocks, 2, block,
  heads, head)``; the "forward pass" writes, into every GPU block a step computed, bytes that
  are a pure function of (prompt tag, block index, rank, layer) -- so the same prompt yields
  the same KV, and another rank's KV differs. After a load, the request's loaded blocks are
  compared with those bytes on every rank (AssertionError otherwise): byte-exact end to end.
* the engine's scheduler loop (a stand-in for vllm/v1/core/sched/scheduler.py): FIFO waiting
  queue, running requests first, a token budget per step (chunked prefill), lookups for
  waiting requests with nothing computed (``None`` = ask again next step), fresh GPU block ids,
  ``WAITING_FOR_REMOTE_KVS`` until every rank reported ``finished_recving``; a load some rank
  reported failed (``failed_recving``, 0.34+) is handled as vLLM's scheduler does under
  ``kv_load_failure_policy`` (``load_failure_policy``: "recompute" computes the request from
  token 0 on fresh blocks, "fail" finishes it with FINISHED_ERROR); a whole-prompt hit
  recomputes its last token; ``max_tokens`` output tokens, then finished.
* the ``VllmConfig``: a namespace with what the connector, spec and worker read.

Bounded: every loop has a step count and a wall-time bound (TimeoutError names what is left).
Threading: driven from the test's thread; MemKV's lookup and transfer threads run underneath,
each step ends with ``step_sleep_s`` (the "model execution" window).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import pickle
import time
import uuid
from collections import Counter
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
except ModuleNotFoundError as exc:  # a venv built with only the tiering code's import deps
    if (exc.name or "").split(".")[0] in ("vllm", "torch", "memkv", "memkv_vllm"):
        raise
    pytest.skip(f"vLLM's OffloadingConnector needs {exc.name!r}, not installed in this venv (noxfile.py "
                "VLLM_IMPORT_DEPS: the engine and structured-output set)", allow_module_level=True)
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from tests.conformance import harness_compat as hc

MODEL_NAME = "harness/direct-model"
NUM_LAYERS = 2
HEADS, HEAD_SIZE = 1, 64
_DTYPE = torch.float16


@dataclasses.dataclass(frozen=True)
class Geometry:
    world_size: int = 1
    gpu_block_size: int = 16  # tokens per GPU block (== tokens per hash block)
    block_size: int = 32  # tokens per offloaded chunk
    num_gpu_blocks: int = 512

    @property
    def blocks_per_chunk(self) -> int:
        return self.block_size // self.gpu_block_size

    @property
    def page_bytes(self) -> int:
        """One layer's bytes of one GPU block on one rank (K and V)."""
        return 2 * self.gpu_block_size * HEADS * HEAD_SIZE * torch.finfo(_DTYPE).bits // 8

    @property
    def value_bytes(self) -> int:
        """One rank's bytes of one chunk: one MemKV value."""
        return NUM_LAYERS * self.page_bytes * self.blocks_per_chunk


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def block_bytes(tag: str, block: int, rank: int, layer: int, nbytes: int) -> bytes:
    """The KV bytes the simulated model computes for a block of prompt ``tag``."""
    return hashlib.shake_256(f"direct/{tag}/{block}/{rank}/{layer}".encode()).digest(nbytes)


def expected_value(tag: str, chunk: int, rank: int, g: Geometry) -> bytes:
    """One rank's MemKV value of chunk ``chunk`` (worker.py's layout: layer-major)."""
    bpc = g.blocks_per_chunk
    return b"".join(block_bytes(tag, chunk * bpc + j, rank, layer, g.page_bytes)
                    for layer in range(NUM_LAYERS) for j in range(bpc))


def _block_hash(tag: str, index: int, parent: bytes | None) -> bytes:
    return hashlib.sha256((parent or b"") + f"{tag}/{index}".encode()).digest()


def prompt_keys(tag: str, num_chunks: int, g: Geometry) -> list[bytes]:
    """Offload keys of the first chunks of prompt ``tag`` (the hash of each chunk's last block)."""
    hashes: list[bytes] = []
    for i in range(num_chunks * g.blocks_per_chunk):
        hashes.append(_block_hash(tag, i, hashes[-1] if hashes else None))
    bpc = g.blocks_per_chunk
    return [make_offload_key(hashes[(c + 1) * bpc - 1], 0) for c in range(num_chunks)]


def direct_config(staging_mb: int = 16, block_size: int = 32, **memkv: Any) -> dict[str, Any]:
    """The extra_config a user writes. lookup_timeout_s defaults to 30 s here: on a loaded
    2-core box the default 5 s can pass, and only the deadline tests want it to."""
    memkv.setdefault("lookup_timeout_s", 30.0)
    return {"spec_name": "MemKVOffloadingSpec", "spec_module_path": "memkv_vllm.direct",
            "block_size": block_size, "memkv": {"staging_mb": staging_mb, **memkv}}


def worker_gpu_arg(gpu_spec: Any, kv_caches: Any) -> Any:
    """What vLLM's connector worker hands OffloadingWorker.submit_store/submit_load for a job's
    GPU side: 0.34+ DevicePointers from vLLM's own resolver, 0.25-0.33 the GPULoadStoreSpec."""
    try:
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers
    except ImportError:  # <= 0.33
        return gpu_spec
    return resolve_device_pointers(gpu_spec, kv_caches)


def _fill(cls: type, values: dict[str, Any]) -> Any:
    return hc.fill_dataclass(cls, values)


def build_kv_cache_config(g: Geometry) -> Any:
    """A real KVCacheConfig: NUM_LAYERS full-attention layers in one group. KVCacheTensor is
    (size, shared_by), one per layer, on 0.25-0.29; from 0.30 one (size, layers, layer_stride,
    block_stride, ...) describes the whole allocation."""
    from vllm.v1 import kv_cache_interface as kvi

    size = g.page_bytes * g.num_gpu_blocks
    names = [layer_name(i) for i in range(NUM_LAYERS)]
    tensor_fields = {f.name for f in dataclasses.fields(kvi.KVCacheTensor)}
    if "layers" in tensor_fields:  # one backing allocation, layer-outermost; `size` is its total
        tensors = [_fill(kvi.KVCacheTensor, {"size": size * NUM_LAYERS, "layers": names, "layer_stride": size,
                                             "block_stride": g.page_bytes})]
    else:
        tensors = [kvi.KVCacheTensor(size=size, shared_by=[n]) for n in names]
    spec = kvi.FullAttentionSpec(block_size=g.gpu_block_size, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=_DTYPE)
    return _fill(kvi.KVCacheConfig, {"num_blocks": g.num_gpu_blocks, "kv_cache_tensors": tensors,
                                     "kv_cache_groups": [kvi.KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)]})


def vllm_config(extra_config: dict[str, Any], g: Geometry, engine_id: str, rank: int) -> SimpleNamespace:
    """Duck-typed VllmConfig with what the connector (both roles), the spec and the worker read."""
    return SimpleNamespace(
        **hc.vllm_config_fields(),
        instance_id=engine_id,
        use_v2_model_runner=False,
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra_config, engine_id=engine_id),
        kv_events_config=None,
        speculative_config=None,
        attention_config=SimpleNamespace(hisparse_config=None),
        model_config=SimpleNamespace(model=MODEL_NAME, dtype="float16", max_model_len=1 << 20, use_mla=False,
                                     get_total_num_kv_heads=lambda: HEADS * g.world_size),
        cache_config=SimpleNamespace(block_size=g.gpu_block_size, cache_dtype="auto", enable_prefix_caching=True,
                                     hash_block_size=None, prefix_match_unit=None, kv_cache_layout=None,
                                     prefix_cache_retention_interval=None),
        parallel_config=SimpleNamespace(
            world_size=g.world_size, rank=rank, tensor_parallel_size=g.world_size, pipeline_parallel_size=1,
            prefill_context_parallel_size=1, decode_context_parallel_size=1, data_parallel_size=1,
            data_parallel_rank=0, data_parallel_rank_local=None, data_parallel_index=0,
            distributed_executor_backend=None, nnodes_within_dp=1, cp_kv_cache_interleave_size=1,
        ),
    )


class Request:
    """The fields of vllm.v1.request.Request the connector reads, plus outcomes."""

    def __init__(self, req_id: str, tag: str, num_prompt_tokens: int, max_tokens: int, g: Geometry) -> None:
        self.request_id = req_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = num_prompt_tokens
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.kv_transfer_params = None
        for name, value in hc.request_fields().items():
            setattr(self, name, value)
        self.block_hashes: list[bytes] = []
        self.tag = tag
        self.max_tokens = max_tokens
        self.num_output_tokens = 0
        self.block_ids: list[int] = []
        self.matched_tokens: int | None = None
        self.deferred_lookups = 0
        self.loaded_blocks = 0
        self.failed_block_ids: list[int] = []  # the GPU blocks of a load that failed
        self._g = g
        self._extend_hashes()

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def _extend_hashes(self) -> None:
        while len(self.block_hashes) < self.num_tokens // self._g.gpu_block_size:
            i = len(self.block_hashes)
            self.block_hashes.append(_block_hash(self.tag, i, self.block_hashes[-1] if self.block_hashes else None))

    def __repr__(self) -> str:
        return f"Request({self.request_id}, {self.status.name}, {self.num_computed_tokens}/{self.num_tokens})"


class DirectEngine:
    """A scheduler-side connector and ``world_size`` worker-side connectors in one step loop.

    ``before_alloc(engine, request, matched_tokens)`` runs after a lookup matched tokens and
    before ``update_state_after_alloc`` (so before the connector commits to the load): the
    place to evict values "between lookup and load"."""

    def __init__(self, g: Geometry = Geometry(), extra_config: dict[str, Any] | None = None, *,
                 token_budget: int = 2048, engine_id: str | None = None, step_sleep_s: float = 0.002,
                 before_alloc: Callable[["DirectEngine", Request, int], None] | None = None,
                 check_loads: bool = True, load_failure_policy: str = "recompute") -> None:
        self.g = g
        self.engine_id = engine_id or f"direct-{uuid.uuid4().hex[:12]}"
        self.extra_config = extra_config or direct_config()
        self.token_budget = token_budget
        self.step_sleep_s = step_sleep_s
        self.before_alloc = before_alloc
        self.check_loads = check_loads  # off only for benches, which call check_loaded() after timing
        self.kv_cache_config = build_kv_cache_config(g)
        self.connector = None
        self.workers: list[OffloadingConnector] = []
        self.kv: list[list[torch.Tensor]] = []  # per rank, per layer
        self._closed = False
        try:
            # Workers first, then the scheduler: the order vLLM's engine core builds them in (the
            # executor's workers allocate and register their KV caches before the Scheduler exists).
            for rank in range(g.world_size):
                worker = OffloadingConnector(vllm_config(copy.deepcopy(self.extra_config), g, self.engine_id, rank),
                                             KVConnectorRole.WORKER, copy.deepcopy(self.kv_cache_config))
                layers = [torch.zeros((g.num_gpu_blocks, 2, g.gpu_block_size, HEADS, HEAD_SIZE), dtype=_DTYPE)
                          for _ in range(NUM_LAYERS)]
                worker.register_kv_caches({layer_name(i): t for i, t in enumerate(layers)})
                self.workers.append(worker)
                self.kv.append(layers)
            self.connector = OffloadingConnector(vllm_config(self.extra_config, g, self.engine_id, 0),
                                                 KVConnectorRole.SCHEDULER, self.kv_cache_config)
            self.manager = self.connector.connector_scheduler.manager
        except BaseException:
            self.shutdown()
            raise
        self.step_count = 0
        self.requests: dict[str, Request] = {}
        self.finished: dict[str, Request] = {}
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._finished_ids: set[str] = set()
        self._next_block = itertools.count(1)  # 0 is the null block
        self._seq = itertools.count()
        self._recving: Counter[str] = Counter()
        self.load_failure_policy = load_failure_policy
        self._failed_pending: set[str] = set()  # some rank reported the load failed
        self.failed_loads: list[str] = []  # request ids whose load failed (all ranks reported)
        self.stats: Counter[tuple[str, tuple]] = Counter()
        self.gauges: dict[tuple[str, tuple], float] = {}
        self.store_jobs = 0
        self.load_jobs = 0

    def __enter__(self) -> "DirectEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, tag: str, num_prompt_tokens: int, max_tokens: int = 1) -> Request:
        req = Request(f"{self.engine_id}-r{next(self._seq)}", tag, num_prompt_tokens, max_tokens, self.g)
        self.connector.on_new_request(req)
        self.requests[req.request_id] = req
        self._waiting.append(req)
        return req

    def run(self, tag: str, num_prompt_tokens: int, timeout_s: float = 30.0) -> Request:
        """One request from arrival to finish, then until nothing is pending (stores put)."""
        req = self.add_request(tag, num_prompt_tokens)
        self.run_until(lambda: req.is_finished(), timeout_s, f"{req} not finished")
        self.run_until_idle(timeout_s)
        return req

    def run_until(self, done: Callable[[], bool], timeout_s: float = 30.0, what: str = "",
                  max_steps: int = 20_000) -> int:
        deadline = time.monotonic() + timeout_s
        for steps in range(max_steps):
            if done():
                return steps
            if time.monotonic() >= deadline:
                break
            self.step()
        if done():
            return max_steps
        raise TimeoutError(f"not done within {timeout_s}s / {max_steps} steps: {what}")

    def run_until_idle(self, timeout_s: float = 30.0) -> int:
        return self.run_until(lambda: not self.requests and not self.connector.has_pending_push_work(),
                              timeout_s, "pending work")

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> None:
        assert not self._closed
        self.step_count += 1
        output = self._schedule()
        meta = self.connector.build_connector_meta(output)
        self.store_jobs += len(meta.store_jobs)
        self.load_jobs += len(meta.load_jobs)
        computed = {rid: (self.requests[rid].num_computed_tokens, n) for rid, n in output.num_scheduled_tokens.items()}
        for rid, n in output.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n
        worker_meta = None
        recving: Counter[str] = Counter()
        for rank, worker in enumerate(self.workers):
            wmeta = pickle.loads(pickle.dumps(meta))  # as the engine ships it to each worker
            worker.bind_connector_metadata(wmeta)
            worker.handle_preemptions(wmeta)
            worker.start_load_kv(None)
            self._forward(rank, computed)
            worker.wait_for_save()
            # 0.34+: the engine asks get_transfer_results, which adds failed_recving; before, get_finished.
            if hasattr(worker.connector_worker, "take_failed_recving"):
                results = worker.get_transfer_results(set(output.finished_req_ids))
                done_recving = results.finished_recving
                self._failed_pending |= set(results.failed_recving or ())
            else:
                _, done_recving = worker.get_finished(set(output.finished_req_ids))
            recving.update(done_recving or ())
            m = worker.build_connector_worker_meta()
            if m is not None:
                worker_meta = m if worker_meta is None else worker_meta.aggregate(m)
            worker.clear_connector_metadata()
        self._recving.update(recving)
        finished_recving = {rid for rid, n in self._recving.items() if n >= self.g.world_size}
        for rid in finished_recving:
            del self._recving[rid]
        finished_now = self._sample(output)
        self._finished_ids = finished_now
        failed = self._failed_pending & finished_recving  # as vLLM's KVOutputAggregator
        self._failed_pending -= failed
        kv_output = {"finished_recving": finished_recving or None, "kv_connector_worker_meta": worker_meta}
        if failed:
            kv_output["failed_recving"] = failed
        self.connector.update_connector_output(KVConnectorOutput(**kv_output))
        for rid in finished_recving:
            req = self.requests[rid]
            assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, req
            if rid in failed:
                self._load_failed(req)
                continue
            if self.check_loads:
                self.check_loaded(req)
            req.status = RequestStatus.WAITING
        self._collect_stats()
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)

    def _load_failed(self, req: Request) -> None:
        """vLLM's Scheduler._handle_failed_recving and _update_waiting_for_remote_kvs (0.34)."""
        self.failed_loads.append(req.request_id)
        req.loaded_blocks = 0
        req.failed_block_ids = list(req.block_ids)  # never handed out again: tests check them after
        if self.load_failure_policy == "recompute":  # nothing computed: blocks freed, the request waits
            req.num_computed_tokens = 0
            req.block_ids = []
            req.status = RequestStatus.WAITING
            return
        req.status = RequestStatus.FINISHED_ERROR
        self._waiting.remove(req)
        self.connector.request_finished_all_groups(req, (list(req.block_ids),))
        self.finished[req.request_id] = self.requests.pop(req.request_id)

    def _schedule(self) -> SimpleNamespace:
        budget = self.token_budget
        new_reqs, cached_ids, cached_blocks = [], [], []
        num_scheduled: dict[str, int] = {}
        for req in self._running:
            n = min(req.num_tokens - req.num_computed_tokens, budget)
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
                if matched and self.before_alloc is not None:
                    self.before_alloc(self, req, matched)
                if load_async:
                    self._allocate(req, matched)
                    self.connector.update_state_after_alloc(req, self._blocks(req), matched)
                    req.num_computed_tokens = matched
                    req.loaded_blocks = matched // self.g.gpu_block_size
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    still_waiting.append(req)
                    continue
            elif req.num_computed_tokens >= req.num_tokens:
                req.num_computed_tokens = req.num_tokens - 1
            n = min(req.num_tokens - req.num_computed_tokens, budget)
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
            scheduled_cached_reqs=SimpleNamespace(req_ids=cached_ids, new_block_ids=cached_blocks,
                                                  resumed_req_ids=set()),
            num_scheduled_tokens=num_scheduled, total_num_scheduled_tokens=sum(num_scheduled.values()),
            preempted_req_ids=set(), finished_req_ids=set(self._finished_ids), partial_tail_offloads={},
            kv_connector_block_state=None, kv_cache_block_copies=None,
        )

    def _allocate(self, req: Request, upto_tokens: int) -> list[int]:
        need = -(-upto_tokens // self.g.gpu_block_size) - len(req.block_ids)
        new = []
        for _ in range(max(0, need)):
            block = next(self._next_block)
            assert block < self.g.num_gpu_blocks, "the simulated GPU ran out of blocks: raise num_gpu_blocks"
            req.block_ids.append(block)
            new.append(block)
        return new

    def _blocks(self, req: Request) -> SimpleNamespace:
        return SimpleNamespace(blocks=([SimpleNamespace(block_id=b, is_null=False, block_hash=None)
                                        for b in req.block_ids],))

    def _forward(self, rank: int, computed: dict[str, tuple[int, int]]) -> None:
        """The model: every block touched by this step's tokens gets its prompt's bytes."""
        g = self.g
        for rid, (start, n) in computed.items():
            req = self.requests[rid]
            for block in range(start // g.gpu_block_size, -(-(start + n) // g.gpu_block_size)):
                gpu = req.block_ids[block]
                for layer in range(NUM_LAYERS):
                    row = self.kv[rank][layer][gpu].view(torch.int8).reshape(-1)
                    row.copy_(torch.frombuffer(bytearray(block_bytes(req.tag, block, rank, layer, g.page_bytes)),
                                               dtype=torch.int8))

    def check_loaded(self, req: Request) -> None:
        """AssertionError unless every loaded block holds its prompt's bytes on every rank."""
        g = self.g
        for rank in range(g.world_size):
            for block in range(req.loaded_blocks):
                for layer in range(NUM_LAYERS):
                    got = self.kv[rank][layer][req.block_ids[block]].view(torch.int8).reshape(-1).numpy().tobytes()
                    assert got == block_bytes(req.tag, block, rank, layer, g.page_bytes), (
                        f"{req.request_id}: rank {rank} layer {layer} block {block} loaded wrong bytes")

    def _sample(self, output: SimpleNamespace) -> set[str]:
        finished = set()
        for rid in output.num_scheduled_tokens:
            req = self.requests[rid]
            if req.num_computed_tokens < req.num_tokens:
                continue
            req.num_tokens += 1
            req.num_output_tokens += 1
            req._extend_hashes()
            if req.num_output_tokens >= req.max_tokens:
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                self._running.remove(req)
                self.connector.request_finished_all_groups(req, (list(req.block_ids),))
                finished.add(rid)
                self.finished[rid] = self.requests.pop(rid)
        return finished

    def _collect_stats(self) -> None:
        stats = self.connector.get_kv_connector_stats()
        if stats is None:
            return
        data = stats.data.get("data", {})
        types = stats.data.get("types", {})
        for name, series in data.items():
            for labels, value in series.items():
                if "gauge" in str(types.get(name, "")).lower():
                    self.gauges[(name, labels)] = value
                else:
                    self.stats[(name, labels)] += len(value) if isinstance(value, list) else value

    def stat(self, name: str, labels: tuple = ()) -> float:
        return self.stats.get((name, labels), 0)

    # -- lifecycle -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for worker in self.workers:
            worker.shutdown()
        if self.connector is not None:
            self.connector.shutdown()
