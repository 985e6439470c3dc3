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
* the engine's scheduler loop: scheduler_standin.SchedulerStandIn, shared with the tier-mode
  connector harness (its docstring says what it does, including ``failed_recving`` under
  ``load_failure_policy``); a load is done when every rank reported it in ``finished_recving``.
* the ``VllmConfig``: a namespace with what the connector, spec and worker read.

Bounded and threaded as scheduler_standin says.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import pickle
import uuid
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
except ModuleNotFoundError as exc:  # a venv built with only the tiering code's import deps
    if (exc.name or "").split(".")[0] in ("vllm", "torch", "memkv", "memkv_vllm"):
        raise
    pytest.skip(
        f"vLLM's OffloadingConnector needs {exc.name!r}, not installed in this venv (noxfile.py "
        "VLLM_IMPORT_DEPS: the engine and structured-output set)",
        allow_module_level=True,
    )
from tests.conformance import harness_compat as hc
from tests.conformance.scheduler_standin import SchedulerStandIn, StandInRequest, WorkerReport, prompt_keys, vllm_config

Request = StandInRequest  # what tests annotate their hooks with
__all__ = [
    "NUM_LAYERS",
    "DirectEngine",
    "Geometry",
    "Request",
    "direct_config",
    "expected_value",
    "prompt_keys",
    "worker_gpu_arg",
]

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
    return b"".join(
        block_bytes(tag, chunk * bpc + j, rank, layer, g.page_bytes) for layer in range(NUM_LAYERS) for j in range(bpc)
    )


def direct_config(staging_mb: int = 16, block_size: int = 32, **memkv: Any) -> dict[str, Any]:
    """The extra_config a user writes. lookup_timeout_s defaults to 30 s here: on a loaded
    2-core box the default 5 s can pass, and only the deadline tests want it to."""
    memkv.setdefault("lookup_timeout_s", 30.0)
    return {
        "spec_name": "MemKVOffloadingSpec",
        "spec_module_path": "memkv_vllm.direct",
        "block_size": block_size,
        "memkv": {"staging_mb": staging_mb, **memkv},
    }


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
        tensors = [
            _fill(
                kvi.KVCacheTensor,
                {"size": size * NUM_LAYERS, "layers": names, "layer_stride": size, "block_stride": g.page_bytes},
            )
        ]
    else:
        tensors = [kvi.KVCacheTensor(size=size, shared_by=[n]) for n in names]
    spec = kvi.FullAttentionSpec(block_size=g.gpu_block_size, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=_DTYPE)
    return _fill(
        kvi.KVCacheConfig,
        {
            "num_blocks": g.num_gpu_blocks,
            "kv_cache_tensors": tensors,
            "kv_cache_groups": [kvi.KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)],
        },
    )


def _vllm_config(extra_config: dict[str, Any], g: Geometry, engine_id: str, rank: int) -> SimpleNamespace:
    return vllm_config(
        extra_config, g, engine_id, model=MODEL_NAME, dtype="float16", num_kv_heads=HEADS * g.world_size, rank=rank
    )


class DirectEngine(SchedulerStandIn):
    """A scheduler-side connector and ``world_size`` worker-side connectors in the stand-in
    scheduler loop.

    ``before_alloc(engine, request, matched_tokens)`` runs after a lookup matched tokens and
    before ``update_state_after_alloc`` (so before the connector commits to the load): the
    place to evict values "between lookup and load"."""

    def __init__(
        self,
        g: Geometry = Geometry(),
        extra_config: dict[str, Any] | None = None,
        *,
        token_budget: int = 2048,
        engine_id: str | None = None,
        step_sleep_s: float = 0.002,
        before_alloc: Callable[[DirectEngine, StandInRequest, int], None] | None = None,
        check_loads: bool = True,
        load_failure_policy: str = "recompute",
    ) -> None:
        self._closed = False
        self.g = g
        engine_id = engine_id or f"direct-{uuid.uuid4().hex[:12]}"
        self.extra_config = extra_config or direct_config()
        self.check_loads = check_loads  # off only for benches, which call check_loaded() after timing
        self.kv_cache_config = build_kv_cache_config(g)
        self.connector = None
        self.workers: list[OffloadingConnector] = []
        self.kv: list[list[torch.Tensor]] = []  # per rank, per layer
        try:
            # Workers first, then the scheduler: the order vLLM's engine core builds them in (the
            # executor's workers allocate and register their KV caches before the Scheduler exists).
            for rank in range(g.world_size):
                worker = OffloadingConnector(
                    _vllm_config(copy.deepcopy(self.extra_config), g, engine_id, rank),
                    KVConnectorRole.WORKER,
                    copy.deepcopy(self.kv_cache_config),
                )
                layers = [
                    torch.zeros((g.num_gpu_blocks, 2, g.gpu_block_size, HEADS, HEAD_SIZE), dtype=_DTYPE)
                    for _ in range(NUM_LAYERS)
                ]
                worker.register_kv_caches({layer_name(i): t for i, t in enumerate(layers)})
                self.workers.append(worker)
                self.kv.append(layers)
            self.connector = OffloadingConnector(
                _vllm_config(self.extra_config, g, engine_id, 0), KVConnectorRole.SCHEDULER, self.kv_cache_config
            )
            self.manager = self.connector.connector_scheduler.manager
        except BaseException:
            self.shutdown()
            raise
        super().__init__(
            self.connector,
            g,
            engine_id=engine_id,
            num_gpu_blocks=g.num_gpu_blocks,
            token_budget=token_budget,
            step_sleep_s=step_sleep_s,
            before_alloc=before_alloc,
            load_failure_policy=load_failure_policy,
        )
        self._recving: Counter[str] = Counter()  # per request, the ranks that finished its load
        self._failed_pending: set[str] = set()  # some rank reported the load failed
        self.store_jobs = 0
        self.load_jobs = 0

    # -- the workers (SchedulerStandIn's hooks) ------------------------------------------------

    def _run_workers(self, meta: Any, output: SimpleNamespace, scheduled: dict[str, tuple[int, int]]) -> WorkerReport:
        """Each rank's worker-side connector through one step, in the engine's call order."""
        self.store_jobs += len(meta.store_jobs)
        self.load_jobs += len(meta.load_jobs)
        worker_meta = None
        for rank, worker in enumerate(self.workers):
            wmeta = pickle.loads(pickle.dumps(meta))  # as the engine ships it to each worker
            worker.bind_connector_metadata(wmeta)
            worker.handle_preemptions(wmeta)
            worker.start_load_kv(None)
            self._forward(rank, scheduled)
            worker.wait_for_save()
            # 0.34+: the engine asks get_transfer_results, which adds failed_recving; before, get_finished.
            if hasattr(worker.connector_worker, "take_failed_recving"):
                results = worker.get_transfer_results(set(output.finished_req_ids))
                done_recving = results.finished_recving
                self._failed_pending |= set(results.failed_recving or ())
            else:
                _, done_recving = worker.get_finished(set(output.finished_req_ids))
            self._recving.update(done_recving or ())
            m = worker.build_connector_worker_meta()
            if m is not None:
                worker_meta = m if worker_meta is None else worker_meta.aggregate(m)
            worker.clear_connector_metadata()
        finished_recving = {rid for rid, n in self._recving.items() if n >= self.g.world_size}
        for rid in finished_recving:
            del self._recving[rid]
        failed = self._failed_pending & finished_recving  # as vLLM's KVOutputAggregator
        self._failed_pending -= failed
        return WorkerReport(finished_recving, failed, worker_meta)

    def _loaded(self, req: StandInRequest) -> None:
        if self.check_loads:
            self.check_loaded(req)

    def _forward(self, rank: int, scheduled: dict[str, tuple[int, int]]) -> None:
        """The model: every block touched by this step's tokens gets its prompt's bytes."""
        g = self.g
        for rid, (start, n) in scheduled.items():
            req = self.requests[rid]
            for block in range(start // g.gpu_block_size, -(-(start + n) // g.gpu_block_size)):
                gpu = req.block_ids[block]
                for layer in range(NUM_LAYERS):
                    row = self.kv[rank][layer][gpu].view(torch.int8).reshape(-1)
                    data = bytearray(block_bytes(req.tag, block, rank, layer, g.page_bytes))
                    row.copy_(torch.frombuffer(data, dtype=torch.int8))

    def check_loaded(self, req: StandInRequest) -> None:
        """AssertionError unless every loaded block holds its prompt's bytes on every rank."""
        g = self.g
        for rank in range(g.world_size):
            for block in range(req.loaded_blocks):
                for layer in range(NUM_LAYERS):
                    got = self.kv[rank][layer][req.block_ids[block]].view(torch.int8).reshape(-1).numpy().tobytes()
                    assert got == block_bytes(req.tag, block, rank, layer, g.page_bytes), (
                        f"{req.request_id}: rank {rank} layer {layer} block {block} loaded wrong bytes"
                    )

    # -- lifecycle -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for worker in self.workers:
            worker.shutdown()
        if self.connector is not None:
            self.connector.shutdown()
