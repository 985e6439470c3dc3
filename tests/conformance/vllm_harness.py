"""Headless driver for vLLM's real secondary-tier offloading stack (vLLM 0.25.0 - 0.34.0).

What is real and what is simulated:

* Real: ``TieringOffloadingSpec`` built from a ``kv_connector_extra_config``-style dict,
  ``spec.get_manager()`` with its ``/dev/shm`` primary region, the
  ``CPUPrimaryTierOffloadingManager`` (LRU), every secondary tier built by
  ``SecondaryTierFactory`` from the tier dicts, and ``TieringOffloadingManager`` driving
  them (cascades, lookups, promotions, job bookkeeping).
* Simulated: the GPU side. There is no model and no GPU worker: ``store_chunks`` writes
  the caller's bytes straight into the primary rows that ``prepare_store`` returned (the
  stand-in for the GPU->CPU DMA), and ``promote_and_read`` reads the rows that
  ``prepare_load`` returned (the stand-in for CPU->GPU). Both transfers complete before
  the call returns, so the connector's worker-completion handling reduces to calling
  ``complete_store`` / ``complete_load`` right away.

The driver calls the manager the way the offloading connector's scheduler side does
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``): lookups and
``on_schedule_end`` of one step inside one locked region, other hooks in short regions,
``shutdown()`` without the lock. The lock is ``manager.lock`` where the manager has one
(0.33) and a no-op before.

Keys are made with vLLM's own ``make_offload_key`` from a 32-byte hash (what the default
``sha256`` prefix hash yields) and a group index. Payloads are deterministic per key, so a
test can check the bytes that come back from any tier byte for byte.

Every wait is bounded twice, by a step count and by wall time: run_until_idle() raises
TimeoutError, lookup_until_resolved() returns a trace with ``resolved=False`` (so a test
can also assert that something is still pending).

Threading: a ``HeadlessEngine`` is driven from one thread (the test's). vLLM's own
threads (tier I/O pools, async-lookup workers, the 0.33 tier-poll thread) run underneath.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import inspect
import itertools
import mmap
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from typing_extensions import Self
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from tests.conformance import harness_compat

__all__ = [
    "DEFAULT_MODEL_NAME",
    "FINAL_RESULTS",
    "Geometry",
    "HeadlessEngine",
    "build_kv_cache_config",
    "LoadedChunks",
    "LookupTrace",
    "StoreOutcome",
    "build_spec",
    "make_key",
    "make_keys",
    "payload_for",
    "primary_view",
    "register_tier",
    "row_bytes",
    "row_ids",
    "shm_region_paths",
    "stats_values",
    "tiering_config",
]

DEFAULT_MODEL_NAME = "harness/tiny-model"
# HIT and MISS are final answers. RETRY (tier probe pending; also the answer that starts
# a promotion on 0.25-0.27) and HIT_PENDING (promotion in flight, 0.28+) mean "ask again".
FINAL_RESULTS = frozenset({LookupResult.HIT, LookupResult.MISS})
_PAGE_BYTES = mmap.PAGESIZE  # TieringOffloadingSpec.BLOCK_SIZE_ALIGNMENT in every release
_LAYER_NAME = "model.layers.0.self_attn.attn"


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Shape of the simulated engine: parallelism, KV sizes and primary-pool size.

    One primary row holds one offloaded chunk for all ranks: ``world_size`` slices of
    ``worker_kv_bytes_per_block * blocks_per_chunk`` bytes, padded to a page.
    """

    world_size: int = 1  # simulated TP ranks; only the row layout depends on it
    worker_kv_bytes_per_block: int = 6000  # one worker's KV bytes per GPU block
    gpu_block_size: int = 16  # tokens per GPU block
    block_size: int = 32  # tokens per offloaded chunk (extra_config "block_size")
    num_rows: int = 8  # primary-pool rows (chunks)

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.num_rows < 1 or self.worker_kv_bytes_per_block < 1:
            raise ValueError(f"bad geometry: {self}")
        if self.block_size % self.gpu_block_size:
            raise ValueError(f"block_size {self.block_size} is not a multiple of gpu_block_size {self.gpu_block_size}")

    @property
    def blocks_per_chunk(self) -> int:
        return self.block_size // self.gpu_block_size

    @property
    def per_worker_chunk_bytes(self) -> int:
        return self.worker_kv_bytes_per_block * self.blocks_per_chunk

    @property
    def row_bytes(self) -> int:
        """round_up(world_size * per_worker_chunk_bytes, page), as CPUOffloadingSpec does."""
        raw = self.world_size * self.per_worker_chunk_bytes
        return -(-raw // _PAGE_BYTES) * _PAGE_BYTES

    @property
    def cpu_bytes_to_use(self) -> int:
        return self.num_rows * self.row_bytes


def tiering_config(
    secondary_tiers: Sequence[Mapping[str, Any]],
    geometry: Geometry = Geometry(),
    **extra: Any,
) -> dict[str, Any]:
    """The kv_connector_extra_config for a TieringOffloadingSpec with these tiers."""
    config: dict[str, Any] = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": geometry.cpu_bytes_to_use,
        "block_size": geometry.block_size,
        # Copies: 0.31+ specs write a resolved "backpressure" entry into the tier dicts.
        "secondary_tiers": [dict(tier) for tier in secondary_tiers],
    }
    config.update(extra)
    return config


def make_key(label: str | bytes, group_idx: int = 0) -> OffloadKey:
    """An OffloadKey from a 32-byte hash of ``label``, built by vLLM's make_offload_key."""
    raw = label.encode() if isinstance(label, str) else label
    return make_offload_key(hashlib.sha256(raw).digest(), group_idx)


def make_keys(n: int, tag: str | None = None, group_idx: int = 0) -> list[OffloadKey]:
    """``n`` distinct keys; a fresh random tag unless one is given (same tag, same keys)."""
    tag = tag or uuid.uuid4().hex
    return [make_key(f"{tag}/{i}", group_idx) for i in range(n)]


def payload_for(key: bytes, nbytes: int) -> bytes:
    """Deterministic ``nbytes`` bytes for ``key`` (different keys, different bytes)."""
    return hashlib.shake_256(b"memkv-harness/" + key).digest(nbytes)


def primary_view(manager: Any) -> memoryview:
    """The primary tier's (num_rows, row_bytes) int8 memoryview, as tiers receive it."""
    return manager.primary_tier.get_kv_memoryview()


def row_bytes(manager_or_spec: Any) -> int:
    """Bytes per primary row (one chunk for all ranks, page padded)."""
    if hasattr(manager_or_spec, "primary_tier"):
        return primary_view(manager_or_spec).strides[0]
    return _spec_row_bytes(manager_or_spec)


def row_ids(load_store_spec: Any) -> list[int]:
    """Primary rows named by the LoadStoreSpec that prepare_store/prepare_load returned."""
    return _row_ids(load_store_spec)


def register_tier(tier_type: str, module_path: str, class_name: str) -> bool:
    """Register an out-of-tree tier class; False if ``tier_type`` was already registered.

    ``register_tier`` raises ValueError on a duplicate name in every release; a test
    (like the plugin entry point) may run it more than once per process.
    """
    try:
        SecondaryTierFactory.register_tier(tier_type, module_path, class_name)
    except ValueError:
        return False
    return True


def shm_region_paths(engine_id: str) -> list[str]:
    """The /dev/shm files of an engine's primary region (0.33 may add numbered segments)."""
    return glob.glob(f"/dev/shm/vllm_offload_{glob.escape(engine_id)}.mmap*")


def stats_values(stats: Any) -> dict[str, dict[tuple, Any]]:
    """``{metric: {labelvalues: value}}`` from an OffloadingConnectorStats (or None).

    Reads ``stats.data["data"]``, the self-describing layout every release 0.25-0.33 uses.
    """
    if stats is None:
        return {}
    return {name: dict(values) for name, values in stats.data.get("data", {}).items()}


def build_spec(
    extra_config: dict[str, Any],
    geometry: Geometry = Geometry(),
    *,
    engine_id: str | None = None,
    model_name: str = DEFAULT_MODEL_NAME,
) -> Any:
    """A real offloading spec (class chosen by ``extra_config["spec_name"]``).

    ``engine_id`` names the /dev/shm region; give each live engine its own.
    """
    engine_id = engine_id or f"harness-{uuid.uuid4().hex[:12]}"
    if extra_config.get("block_size", geometry.block_size) != geometry.block_size:
        raise ValueError("extra_config block_size disagrees with the geometry")
    if _spec_takes_offloading_config():
        config = _build_offloading_config(extra_config, geometry, engine_id, model_name)
        return OffloadingSpecFactory.create_spec(config)
    vllm_config, kv_cache_config = _build_vllm_and_kv_cache_config(extra_config, geometry, engine_id, model_name)
    return OffloadingSpecFactory.create_spec(vllm_config, kv_cache_config)


# =====================================================================================
# Version shims: the only code here that knows vLLM releases differ. Each names the
# release range it serves and detects the feature rather than comparing versions.
# =====================================================================================


def _fill_dataclass(cls: type, values: Mapping[str, Any]) -> Any:
    """harness_compat.fill_dataclass (shared with the other harnesses)."""
    return harness_compat.fill_dataclass(cls, values)


def _spec_takes_offloading_config() -> bool:
    """0.26+: create_spec(config: OffloadingConfig); 0.25: create_spec(vllm_config,
    kv_cache_config) (the spec constructors changed the same way)."""
    params = inspect.signature(OffloadingSpecFactory.create_spec).parameters
    return "kv_cache_config" not in params


def _build_offloading_config(extra_config: dict[str, Any], geometry: Geometry, engine_id: str, model_name: str) -> Any:
    """0.26+: the OffloadingConfig the connector's build_offloading_config would produce
    for one full-attention group of one layer."""
    from vllm.v1.kv_offload import config as cfg

    group = _fill_dataclass(
        cfg.OffloadingGroupConfig,
        {
            "tokens_per_block": geometry.gpu_block_size,
            "layer_names": (_LAYER_NAME,),
            "group_id": 0,  # 0.30+
            "sliding_window_size_in_chunks": None,  # 0.33: a full-attention layer
        },
    )
    model = _fill_dataclass(
        cfg.OffloadingModelConfig,
        {
            "name": model_name,
            "dtype": "bfloat16",
            "max_model_len": 0,  # 0.33: unknown
        },
    )
    cache = _fill_dataclass(
        cfg.OffloadingCacheConfig,
        {
            "tokens_per_hash": geometry.gpu_block_size,
            "blocks_per_chunk": geometry.blocks_per_chunk,
        },
    )
    parallel = _fill_dataclass(
        cfg.OffloadingParallelConfig,
        {
            "rank": 0,  # the scheduler side
            "world_size": geometry.world_size,
            "tp_size": geometry.world_size,
            "pp_size": 1,
            "pcp_size": 1,
            "dcp_size": 1,
            "data_parallel_index": 0,
            "data_parallel_size": 1,  # 0.28+
            "data_parallel_rank_local": None,  # 0.28+
            # One non-MLA full-attention group: what the connector marks portable.
            "is_parallelism_agnostic": True,
        },
    )
    return _fill_dataclass(
        cfg.OffloadingConfig,
        {
            "groups": (group,),
            "worker_kv_bytes_per_block": geometry.worker_kv_bytes_per_block,
            "enable_kv_cache_events": False,
            "extra_config": extra_config,
            "engine_id": engine_id,
            "model": model,
            "cache": cache,
            "parallel": parallel,
        },
    )


def _build_vllm_and_kv_cache_config(
    extra_config: dict[str, Any], geometry: Geometry, engine_id: str, model_name: str
) -> tuple[Any, Any]:
    """0.25: a duck-typed VllmConfig (only what the spec, the primary region and the fs
    tier's FileMapper read) and a real KVCacheConfig with one full-attention group whose
    GPU tensor holds ``worker_kv_bytes_per_block`` per block."""
    kv_cache_config = build_kv_cache_config(geometry, num_gpu_blocks=16)
    vllm_config = SimpleNamespace(
        instance_id=engine_id,
        use_v2_model_runner=False,
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra_config, engine_id=engine_id),
        kv_events_config=None,
        model_config=SimpleNamespace(model=model_name, use_mla=False),
        cache_config=SimpleNamespace(
            block_size=geometry.gpu_block_size,
            cache_dtype="auto",
            enable_prefix_caching=True,
            hash_block_size=None,
        ),
        parallel_config=SimpleNamespace(
            world_size=geometry.world_size,
            tensor_parallel_size=geometry.world_size,
            pipeline_parallel_size=1,
            prefill_context_parallel_size=1,
            decode_context_parallel_size=1,
            rank=0,
            data_parallel_rank=0,
        ),
    )
    return vllm_config, kv_cache_config


def build_kv_cache_config(geometry: Geometry, num_gpu_blocks: int = 16) -> Any:
    """A real KVCacheConfig: one full-attention group of one layer whose GPU tensor holds
    ``worker_kv_bytes_per_block`` per block (scheduler side: only arithmetic, no allocation).

    KVCacheTensor: ``(size, shared_by, ...)`` on 0.25-0.29; ``(size, layers, layer_stride,
    block_stride, ...)`` from 0.30 (a layer-outermost layout for one layer is filled in).
    KVCacheConfig gains defaulted fields from 0.30; _fill_dataclass leaves them at defaults.
    """
    import torch
    from vllm.v1 import kv_cache_interface as kvi

    size = geometry.worker_kv_bytes_per_block * num_gpu_blocks
    tensor_fields = {f.name for f in dataclasses.fields(kvi.KVCacheTensor)}
    if "layers" in tensor_fields:  # 0.30+
        tensor = _fill_dataclass(
            kvi.KVCacheTensor,
            {
                "size": size,
                "layers": [_LAYER_NAME],
                "layer_stride": size,
                "block_stride": geometry.worker_kv_bytes_per_block,
            },
        )
    else:
        tensor = kvi.KVCacheTensor(size=size, shared_by=[_LAYER_NAME])
    kv_cache_spec = kvi.FullAttentionSpec(
        block_size=geometry.gpu_block_size,
        num_kv_heads=1,
        head_size=64,
        dtype=torch.bfloat16,
    )
    return _fill_dataclass(
        kvi.KVCacheConfig,
        {
            "num_blocks": num_gpu_blocks,
            "kv_cache_tensors": [tensor],
            "kv_cache_groups": [kvi.KVCacheGroupSpec(layer_names=[_LAYER_NAME], kv_cache_spec=kv_cache_spec)],
        },
    )


def _spec_row_bytes(spec: Any) -> int:
    """0.26+: kv_bytes_per_chunk; 0.25: kv_bytes_per_offloaded_block (both page aligned)."""
    if hasattr(spec, "kv_bytes_per_chunk"):
        return spec.kv_bytes_per_chunk
    return spec.kv_bytes_per_offloaded_block


def _spec_num_rows(spec: Any) -> int:
    """0.30+: num_chunks; 0.25-0.29: num_blocks."""
    if hasattr(spec, "num_chunks"):
        return spec.num_chunks
    return spec.num_blocks


def _manager_lock(manager: Any) -> contextlib.AbstractContextManager:
    """0.33: manager.lock (a real Lock for TieringOffloadingManager); earlier: none."""
    lock = getattr(manager, "lock", None)
    return lock if lock is not None else contextlib.nullcontext()


def _after_reset(manager: Any) -> None:
    """0.33: promotions stay held after reset_cache() until on_reset_flushed(); the
    connector calls it at once when no worker job is in flight, as here."""
    on_reset_flushed = getattr(manager, "on_reset_flushed", None)
    if on_reset_flushed is not None:
        on_reset_flushed()


def _row_ids(load_store_spec: Any) -> list[int]:
    """Primary rows of a CPULoadStoreSpec: ``block_ids`` in every release (0.30+ also
    aliases it as ``chunk_ids``; int64 before 0.30, int32 from 0.30)."""
    return [int(row) for row in load_store_spec.block_ids]


# =====================================================================================
# The driver
# =====================================================================================


@dataclasses.dataclass
class StoreOutcome:
    """What one store_chunks call did in the primary tier."""

    rows: dict[OffloadKey, int]  # keys newly stored -> primary row they were written to
    evicted: list[OffloadKey]  # keys the primary tier evicted to make room


@dataclasses.dataclass
class LoadedChunks:
    """Chunks read back from the primary tier after prepare_load."""

    rows: dict[OffloadKey, int]  # key -> primary row prepare_load pointed at
    data: dict[OffloadKey, bytes]  # key -> the row's bytes
    trace: LookupTrace  # the lookups that led to the load


@dataclasses.dataclass
class LookupTrace:
    """The manager's answers for ``keys``, one tuple per scheduler step."""

    keys: list[OffloadKey]
    steps: list[tuple[LookupResult, ...]]
    elapsed_s: float
    resolved: bool  # every key ended HIT or MISS within the bounds

    @property
    def final(self) -> tuple[LookupResult, ...]:
        return self.steps[-1] if self.steps else ()

    def per_key(self, index: int) -> list[LookupResult]:
        return [step[index] for step in self.steps]

    def summary(self, index: int = 0) -> str:
        """E.g. 'RETRY x1 -> HIT_PENDING x1 -> HIT x1' for key ``index``."""
        runs = itertools.groupby(self.per_key(index))
        return " -> ".join(f"{r.name} x{len(list(g))}" for r, g in runs)


class HeadlessEngine:
    """A TieringOffloadingManager built from a real spec, driven like the scheduler does.

    Use as a context manager, or call shutdown(). Method arguments ``req`` are the
    ReqContext objects new_request() returned.
    """

    def __init__(
        self,
        secondary_tiers: Sequence[Mapping[str, Any]],
        geometry: Geometry = Geometry(),
        *,
        extra_config: Mapping[str, Any] | None = None,
        engine_id: str | None = None,
        model_name: str = DEFAULT_MODEL_NAME,
    ) -> None:
        self.geometry = geometry
        self.engine_id = engine_id or f"harness-{uuid.uuid4().hex[:12]}"
        self.config = tiering_config(secondary_tiers, geometry, **dict(extra_config or {}))
        self.spec = build_spec(self.config, geometry, engine_id=self.engine_id, model_name=model_name)
        self.manager = self.spec.get_manager()
        self.view = primary_view(self.manager)
        self.row_bytes = self.view.strides[0]
        self.num_rows = _spec_num_rows(self.spec)
        if self.row_bytes != geometry.row_bytes:
            self.manager.shutdown()
            raise AssertionError(f"row is {self.row_bytes} B, geometry says {geometry.row_bytes}")
        # A flat byte view for writing/reading rows; released in shutdown() because a
        # live export keeps the /dev/shm mmap from closing (BufferError on 0.25).
        self._flat: memoryview | None = self.view.cast("B")
        # Hold it around manager calls of your own (a no-op context before 0.33); the
        # driver's methods take it themselves, and it is not reentrant.
        self.lock = _manager_lock(self.manager)
        self._lock = self.lock  # older name, kept for existing callers
        self._new_req_ids: list[str] = []
        self._req_seq = itertools.count()
        self.payloads: dict[OffloadKey, bytes] = {}  # every payload written, by key
        self._closed = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- scheduler-side calls ---------------------------------------------------------

    def new_request(
        self,
        req_id: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> ReqContext:
        """on_new_request for a new ReqContext; it is reported as new at the next step."""
        req = ReqContext(
            req_id=req_id or f"req-{next(self._req_seq)}",
            kv_transfer_params=kv_transfer_params,
        )
        with self.lock:
            self.manager.on_new_request(req)
        self._new_req_ids.append(req.req_id)
        return req

    def finish_request(self, req: ReqContext) -> None:
        """on_request_finished (the manager delays the tiers' copy until stores settle)."""
        with self.lock:
            self.manager.on_request_finished(req)

    def store_chunks(
        self,
        req: ReqContext,
        keys: Sequence[OffloadKey],
        payloads: Mapping[OffloadKey, bytes] | None = None,
    ) -> StoreOutcome:
        """prepare_store -> write each new key's bytes into its row -> complete_store.

        complete_store submits the cascade to every secondary tier; call
        run_until_idle() to wait for it. Default payloads come from payload_for().
        """
        with self.lock:
            out = self.manager.prepare_store(list(keys), req)
        assert out is not None, "prepare_store returned None: no evictable primary rows"
        rows = dict(zip(out.keys_to_store, _row_ids(out.store_spec), strict=True))
        for key, row in rows.items():
            data = payloads[key] if payloads is not None else payload_for(key, self.row_bytes)
            self._write_row(row, data)
            self.payloads[key] = data
        if rows:  # the manager counts a pending store only when something was prepared
            with self.lock:
                self.manager.complete_store(list(rows), req)
        return StoreOutcome(rows=rows, evicted=list(out.evicted_keys))

    def step(self, preempted_req_ids: Iterable[str] = ()) -> None:
        """End one scheduler step: on_schedule_end with this step's new requests.

        The manager polls the tiers' finished jobs inside on_schedule_end (at most once
        per step) and flushes promotions and lookup batches there.
        """
        with self.lock:
            self.end_step_locked(preempted_req_ids)

    def has_pending_work(self) -> bool:
        with self.lock:
            return self.manager.has_pending_work()

    def run_until_idle(self, timeout_s: float = 10.0, max_steps: int = 10_000, poll_s: float = 0.002) -> int:
        """Step until has_pending_work() is False; returns the steps taken."""
        deadline = time.monotonic() + timeout_s
        for steps in range(max_steps):
            if not self.has_pending_work():
                return steps
            if time.monotonic() >= deadline:
                break
            self.step()
            time.sleep(poll_s)  # the model-execution window: tier threads run
        raise TimeoutError(f"manager still has pending work after {steps} steps / {timeout_s} s")

    def in_primary(self, key: OffloadKey) -> bool:
        """Whether the primary tier holds ``key`` (readable or being written)."""
        probe = ReqContext(req_id="harness-probe")
        with self.lock:
            result = self.manager.primary_tier.lookup(key, probe)
        return result in (LookupResult.HIT, LookupResult.HIT_PENDING)

    def fill_pool_to_evict(self, keys: Sequence[OffloadKey], timeout_s: float = 30.0) -> list[OffloadKey]:
        """Store one pool's worth of filler chunks so LRU evicts ``keys``; returns the
        evicted keys. Waits for every cascade first (pinned rows cannot be evicted) and
        after (so promotions find evictable rows). Asserts ``keys`` left the primary."""
        self.run_until_idle(timeout_s)
        filler = self.new_request(f"filler-{next(self._req_seq)}")
        fillers = make_keys(self.num_rows, tag=f"filler/{self.engine_id}/{filler.req_id}")
        outcome = self.store_chunks(filler, fillers)
        self.finish_request(filler)
        self.step()
        self.run_until_idle(timeout_s)
        still_there = [key.hex()[:16] for key in keys if self.in_primary(key)]
        assert not still_there, f"keys not evicted from the primary tier: {still_there}"
        return outcome.evicted

    def lookup_until_resolved(
        self,
        keys: Sequence[OffloadKey],
        req: ReqContext,
        max_steps: int = 100,
        timeout_s: float = 10.0,
        poll_s: float = 0.005,
    ) -> LookupTrace:
        """Look ``keys`` up once per step until each is HIT or MISS, or a bound is hit.

        One step is, as in the scheduler, every lookup then on_schedule_end under one
        lock region, followed by ``poll_s`` of "model execution" in which tier threads
        work. Never raises on the bounds: check ``trace.resolved``.
        """
        keys = list(keys)
        steps: list[tuple[LookupResult, ...]] = []
        start = time.monotonic()
        resolved = False
        for _ in range(max_steps):
            with self.lock:
                results = tuple(self.manager.lookup(key, req) for key in keys)
                steps.append(results)
                resolved = all(r in FINAL_RESULTS for r in results)
                if not resolved:
                    self.end_step_locked()
            if resolved or time.monotonic() - start >= timeout_s:
                break
            time.sleep(poll_s)
        return LookupTrace(keys, steps, time.monotonic() - start, resolved)

    def promote_and_read(
        self,
        keys: Sequence[OffloadKey],
        req: ReqContext | None = None,
        max_steps: int = 100,
        timeout_s: float = 10.0,
    ) -> LoadedChunks:
        """Look ``keys`` up until HIT (promoting them from a tier where needed), then
        prepare_load, read their rows, complete_load. Asserts every key hit."""
        own_req = req is None
        req = req or self.new_request()
        trace = self.lookup_until_resolved(keys, req, max_steps, timeout_s)
        assert trace.resolved and all(r is LookupResult.HIT for r in trace.final), (
            f"not all keys hit: {[trace.summary(i) for i in range(len(keys))]}"
        )
        with self.lock:
            rows = dict(
                zip(
                    keys,
                    _row_ids(self.manager.prepare_load(list(keys), req)),
                    strict=True,
                )
            )
        data = {key: self.read_row(row) for key, row in rows.items()}
        with self.lock:
            self.manager.complete_load(list(keys), req)
        if own_req:
            self.finish_request(req)
            self.step()
        return LoadedChunks(rows=rows, data=data, trace=trace)

    def take_events(self) -> list[Any]:
        with self.lock:
            return list(self.manager.take_events())

    def get_stats(self) -> Any:
        """The manager's OffloadingConnectorStats since the last call (or None)."""
        with self.lock:
            return self.manager.get_stats()

    def reset_cache(self) -> None:
        """reset_cache (drains every tier's jobs, empties the primary), as after sleep."""
        with self.lock:
            self.manager.reset_cache()
            _after_reset(self.manager)

    def shutdown(self) -> None:
        """Shut the manager down (without the lock, as the connector does) and assert
        the primary region's /dev/shm files are gone. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._flat is not None:
            self._flat.release()
            self._flat = None
        self.manager.shutdown()
        leftover = shm_region_paths(self.engine_id)
        assert not leftover, f"primary region not removed at shutdown: {leftover}"

    def end_step_locked(self, preempted_req_ids: Iterable[str] = ()) -> None:
        """step() for a caller that already holds ``self.lock`` (e.g. its own lookups
        and the step end in one region, as the scheduler does)."""
        context = ScheduleEndContext(
            new_req_ids=list(self._new_req_ids),
            preempted_req_ids=list(preempted_req_ids),
        )
        self._new_req_ids.clear()
        self.manager.on_schedule_end(context)

    _end_step = end_step_locked  # older name, kept for existing callers

    # -- internals --------------------------------------------------------------------

    def _write_row(self, row: int, data: bytes) -> None:
        if len(data) != self.row_bytes:
            raise ValueError(f"payload is {len(data)} bytes, a row is {self.row_bytes}")
        assert self._flat is not None, "engine is shut down"
        self._flat[row * self.row_bytes : (row + 1) * self.row_bytes] = data

    def read_row(self, row: int) -> bytes:
        """The current bytes of primary row ``row``."""
        assert self._flat is not None, "engine is shut down"
        return bytes(self._flat[row * self.row_bytes : (row + 1) * self.row_bytes])

    _read_row = read_row  # older name, kept for existing callers
