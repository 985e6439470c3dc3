"""The only module that knows vLLM's offloading API differs between releases 0.25.0 and 0.34.0.

Every shim detects a feature (hasattr, inspect.signature, dataclasses.fields) instead of
comparing version strings, and its comment names the releases it covers. The reference is
docs/vllm-api.md (section numbers below point into it).

Imports of vLLM happen here at module import; `memkv_vllm.tier` imports this module, and vLLM
imports `memkv_vllm.tier` only when a `memkv` tier is configured (lazy registration).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from collections.abc import Collection
from typing import Any

from vllm.v1.kv_offload import base as _offload_base
from vllm.v1.kv_offload.base import (  # identical in every release
    LookupResult,
    OffloadingCounterMetadata,
    OffloadingHistogramMetadata,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

__all__ = [
    "LookupResult",
    "OffloadingCounterMetadata",
    "OffloadingHistogramMetadata",
    "RequestOffloadingContext",
    "SecondaryTierManager",
    "JobResult",
]

# -- constructor (section 2) -----------------------------------------------------------------------
# 0.31+: the factory always passes `backpressure_detector=` and the base __init__ accepts it.
BASE_ACCEPTS_BACKPRESSURE = "backpressure_detector" in inspect.signature(SecondaryTierManager.__init__).parameters


def init_base(
    tier: SecondaryTierManager, offloading_spec, primary_kv_view: memoryview, tier_type: str, backpressure_detector: Any
) -> None:
    if BASE_ACCEPTS_BACKPRESSURE:
        SecondaryTierManager.__init__(tier, offloading_spec, primary_kv_view, tier_type, backpressure_detector)
    else:
        SecondaryTierManager.__init__(tier, offloading_spec, primary_kv_view, tier_type)


# -- class attributes (section 3) ------------------------------------------------------------------
# 0.27+: `Medium` enum (CPU, STORAGE). MemKV is memory, so CPU is the honest medium for
# TierFilter matching. 0.25/0.26: no enum; the attribute is unused there.
_Medium = getattr(_offload_base, "Medium", None)
TIER_MEDIUM = _Medium.CPU if _Medium is not None else None

# 0.32+: `cache_hit_source` is derived from `medium` (CPU -> "host", i.e. the CPU pool) unless
# set; a remote memory store is not the local pool, so say "external_unspecified" explicitly.
try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as _CacheHitSource

    TIER_CACHE_HIT_SOURCE: Any = _CacheHitSource.EXTERNAL_UNSPECIFIED
except ImportError:  # <= 0.31
    TIER_CACHE_HIT_SOURCE = None

# 0.26+: `Locality` enum; a cluster reached over the network is REMOTE.
_Locality = getattr(_offload_base, "Locality", None)


def parse_locality(value: str | None):
    if _Locality is None:
        return None
    return _Locality(value) if value is not None else _Locality.REMOTE


# -- job descriptors (section 4) -------------------------------------------------------------------
def job_slot_ids(job) -> Collection[int]:
    """Primary-pool rows of a job: `chunk_ids` from 0.30, `block_ids` before."""
    ids = getattr(job, "chunk_ids", None)
    return job.block_ids if ids is None else ids


_RESULT_FIELDS = {f.name for f in dataclasses.fields(JobResult)}


# 0.34+: `JobResult.deferred_release` (a threading.Event): a failed promotion's keys miss at once
# while its rows stay out of the free pool until the tier sets the event. Before 0.34 the tier
# withholds such a job's report instead (load_failure_grace_s).
HAS_DEFERRED_RELEASE = "deferred_release" in _RESULT_FIELDS


def job_result(
    job_id: int,
    success: bool,
    *,
    successful_keys: Collection[bytes] | None = None,
    transfer_time: float | None = None,
    transfer_bytes: int | None = None,
    deferred_release: Any = None,
) -> JobResult:
    """A JobResult with the optional fields this release has (0.28: successful_keys,
    transfer_time; 0.31: transfer_bytes; 0.34: deferred_release); the dataclass rejects
    unknown kwargs. A deferred_release on a release without the field is a caller bug."""
    kwargs: dict[str, Any] = {"job_id": job_id, "success": success}
    if deferred_release is not None:
        if not HAS_DEFERRED_RELEASE:
            raise TypeError("this vLLM release has no JobResult.deferred_release")
        kwargs["deferred_release"] = deferred_release
    if successful_keys and "successful_keys" in _RESULT_FIELDS:
        kwargs["successful_keys"] = tuple(successful_keys)
    if transfer_time is not None and "transfer_time" in _RESULT_FIELDS:
        kwargs["transfer_time"] = transfer_time
    if transfer_bytes is not None and "transfer_bytes" in _RESULT_FIELDS:
        kwargs["transfer_bytes"] = transfer_bytes
    return JobResult(**kwargs)


# -- key namespace (section 5) ---------------------------------------------------------------------
def file_mapper_for(offloading_spec, root: str) -> FileMapper:
    """vLLM's own FileMapper, used only to name keys. The kwarg was `gpu_blocks_per_file` and
    the spec attribute `block_size_factor` in 0.25; `blocks_per_file` / `blocks_per_chunk` from 0.26."""
    params = inspect.signature(FileMapper.from_offloading_spec).parameters
    per_chunk = getattr(offloading_spec, "blocks_per_chunk", None)
    if per_chunk is None:
        per_chunk = offloading_spec.block_size_factor
    kw = "blocks_per_file" if "blocks_per_file" in params else "gpu_blocks_per_file"
    kwargs = {kw: per_chunk}
    if "parallel_agnostic" in params:
        kwargs["parallel_agnostic"] = True  # as the fs tier does: FileMapper decides if it applies
    return FileMapper.from_offloading_spec(root, offloading_spec, **kwargs)


def block_hash_and_group(key: bytes) -> tuple[bytes, int]:
    """An OffloadKey is block_hash + group_idx as 4 big-endian bytes (all releases)."""
    return bytes(key[:-4]), int.from_bytes(key[-4:], "big")


# -- hash seed (section 6) -------------------------------------------------------------------------
def block_hash_reuse_problem() -> str | None:
    """Why this process's block hashes cannot match another process's, or None.

    <= 0.32: NONE_HASH is random per process unless PYTHONHASHSEED is set.
    0.33+: a fixed default seed for cryptographic hashes (sha256, the default); random only for
    xxhash-based ones. The module is already imported in the engine process; never import it
    here (it drags half of vLLM in).
    """
    if os.environ.get("PYTHONHASHSEED") is not None:
        return None
    utils = sys.modules.get("vllm.v1.core.kv_cache_utils")
    if utils is not None and hasattr(utils, "resolve_none_hash_seed"):
        seed = getattr(utils, "_NONE_HASH_SEED", None)
        default = getattr(utils, "DEFAULT_NONE_HASH_SEED", None)
        if seed is None or seed == default:
            return None
        return (
            "PYTHONHASHSEED is not set and the prefix-caching hash is not cryptographic, so "
            "block hashes are random per process"
        )
    if utils is None:
        # Not imported: cannot tell whether this release seeds randomly; say what to do.
        return "PYTHONHASHSEED is not set; on vLLM releases before 0.33 block hashes are random per process"
    return "PYTHONHASHSEED is not set, so this vLLM release seeds block hashes randomly per process"


# -- 0.33 config info metric (section 7) -----------------------------------------------------------
HAS_CONFIG_INFO = hasattr(SecondaryTierManager, "config_info_keys")


# -- direct mode: the OffloadingSpec API (section 9) ----------------------------------------------
@dataclasses.dataclass(frozen=True)
class SpecGeometry:
    """What a direct-mode spec needs from vLLM's spec base, in one release-neutral shape."""

    rank: int  # this process's worker rank (0 on the scheduler side)
    world_size: int  # workers per engine: every job is run by each of them
    blocks_per_chunk: int  # GPU blocks per offloaded chunk (one key)
    worker_bytes_per_block: int  # KV bytes one worker holds per GPU block, all offloaded layers
    engine_id: str
    tokens_per_chunk: int = 0  # prompt tokens one chunk (one key) covers
    num_groups: int = 1  # offloaded KV groups: a span of the prompt takes one chunk per group
    max_model_len: int = 0  # 0: this release does not tell the spec


def _per_group(tokens_per_block) -> tuple[int, ...]:
    """GPU block tokens: one int, or one per offloaded KV group (a tuple in some releases)."""
    if isinstance(tokens_per_block, (tuple, list)):
        return tuple(int(t) for t in tokens_per_block) or (0,)
    return (int(tokens_per_block),)


def spec_geometry(spec) -> SpecGeometry:
    """0.26+: `spec.config` (OffloadingConfig) and `blocks_per_chunk`; 0.25: the spec keeps
    `vllm_config`/`kv_cache_config` and `block_size_factor`, and bytes per block come from
    the KV cache tensors (section 9)."""
    config = getattr(spec, "config", None)
    if config is not None and hasattr(config, "worker_kv_bytes_per_block"):
        parallel = config.parallel
        per_group = _per_group(spec.tokens_per_block)
        model = getattr(config, "model", None)
        return SpecGeometry(
            int(parallel.rank),
            int(parallel.world_size),
            int(spec.blocks_per_chunk),
            int(config.worker_kv_bytes_per_block),
            str(config.engine_id),
            min(per_group) * int(spec.blocks_per_chunk),
            len(per_group),
            int(getattr(model, "max_model_len", 0) or 0),
        )  # 0.33+
    vllm_config, kv = spec.vllm_config, spec.kv_cache_config
    tensors = kv.kv_cache_tensors
    packed = [t for t in tensors if getattr(t, "block_stride", 0)]
    total = packed[0].size if packed else sum(t.size for t in tensors)
    parallel = vllm_config.parallel_config
    model = getattr(vllm_config, "model_config", None)
    per_group = _per_group(spec.gpu_block_size)
    return SpecGeometry(
        int(getattr(parallel, "rank", 0)),
        int(parallel.world_size),
        int(spec.block_size_factor),
        int(total // kv.num_blocks),
        str(vllm_config.kv_transfer_config.engine_id),
        min(per_group) * int(spec.block_size_factor),
        len(per_group),
        int(getattr(model, "max_model_len", 0) or 0),
    )


def vllm_release_tag() -> str:
    """`v<major>.<minor>` of the running vLLM. Direct-mode values are the worker's own page
    bytes, whose layout vLLM picks per release (HND and cross-layer tensors <= 0.28, LBHNC from
    0.29, packed layouts...): keys carry the release so no engine reads another layout's bytes."""
    import vllm

    parts = str(getattr(vllm, "__version__", "0.0")).split(".")
    return "v" + ".".join(parts[:2])


# 0.33: `submit_load(..., expedited=True)` for loads inside sync_load_budget_bytes; the
# worker accepts the keyword in every release (older ones never pass it).
# 0.25: LoadStoreSpec.medium() is abstract; 0.26+ a plain marker class. Define it always.


# 0.34+: the connector resolves a job's GPU blocks into `DevicePointers` (pointer_utils.
# resolve_device_pointers: per group, per data ref, per block `tensor.data_ptr() + block_id *
# tensor.stride(0)`) and hands the worker those instead of the GPULoadStoreSpec; 0.25-0.33 pass
# the GPULoadStoreSpec (block_ids, group_sizes, block_indices).
HAS_DEVICE_POINTERS = hasattr(_offload_base, "DevicePointers")


@dataclasses.dataclass(frozen=True)
class GpuBlocks:
    """A job's GPU side in every release's terms: block ids in group order, blocks per group,
    and each group's logical index of its first block."""

    block_ids: list[int]
    group_sizes: list[int]
    block_indices: list[int]


def gpu_blocks(gpu_arg, kv_caches) -> GpuBlocks:
    """The GPU blocks of a job from what the connector passed the worker: a GPULoadStoreSpec
    (0.25-0.33) or DevicePointers (0.34+). Pointers are mapped back to block ids through the
    same CanonicalKVCaches the worker was given (the inverse of resolve_device_pointers); a
    pointer or size that is not one of its rows is a RuntimeError, never a copy to a wrong row."""
    if not hasattr(gpu_arg, "ptrs"):
        return GpuBlocks(
            [int(b) for b in gpu_arg.block_ids],
            [int(n) for n in gpu_arg.group_sizes],
            [int(i) for i in gpu_arg.block_indices],
        )
    import numpy as np

    ptrs = np.asarray(gpu_arg.ptrs, dtype=np.uint64)
    sizes = np.asarray(gpu_arg.sizes, dtype=np.uint64)
    counts = [int(n) for n in gpu_arg.group_block_counts]
    n_refs = [int(n) for n in gpu_arg.group_data_ref_counts]
    if len(counts) != len(kv_caches.group_data_refs) or len(n_refs) != len(counts):
        raise RuntimeError(
            f"MemKV direct mode: DevicePointers name {len(counts)} KV group(s), the worker has "
            f"{len(kv_caches.group_data_refs)}"
        )
    block_ids: list[int] = []
    offset = 0
    for g, (n, refs) in enumerate(zip(counts, kv_caches.group_data_refs)):
        if n == 0:
            continue
        if n_refs[g] != len(refs):
            raise RuntimeError(
                f"MemKV direct mode: DevicePointers give KV group {g} {n_refs[g]} layer(s), the worker has {len(refs)}"
            )
        ids = None
        for ref in refs:
            tensor = kv_caches.tensors[ref.tensor_idx].tensor
            base, stride = np.uint64(tensor.data_ptr()), int(tensor.stride(0))
            row = ptrs[offset : offset + n]
            rel = (row - base).astype(np.int64)  # wraps negative for a pointer below the tensor
            got = rel // stride
            if (
                len(row) != n
                or (rel < 0).any()
                or (rel % stride).any()
                or (got >= tensor.shape[0]).any()
                or (sizes[offset : offset + n] != ref.page_size_bytes).any()
            ):
                raise RuntimeError(
                    f"MemKV direct mode: DevicePointers of KV group {g} do not address whole blocks "
                    f"of its tensor {ref.tensor_idx}"
                )
            if ids is None:
                ids = got
            elif not (ids == got).all():
                raise RuntimeError(f"MemKV direct mode: DevicePointers of KV group {g} name different blocks per layer")
            offset += n
        assert ids is not None
        block_ids += ids.tolist()
    if offset != len(ptrs):
        raise RuntimeError(f"MemKV direct mode: DevicePointers hold {len(ptrs)} pointer(s), the groups use {offset}")
    return GpuBlocks(block_ids, counts, [int(i) for i in gpu_arg.block_indices])


def load_failure_reportable() -> bool:
    """0.34+: the connector worker turns a job reported with `success=False` into a failed load
    (`failed_recving`; the request recomputes under kv_load_failure_policy "recompute", or ends
    with an error under the default "fail") or a failed store (`complete_store(success=False)`).
    0.25-0.33 assert `success` for every job: a failure can only stop the engine."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker

    return hasattr(OffloadingConnectorWorker, "take_failed_recving")


def load_failure_policy() -> str | None:
    """0.34+: the engine's `kv_load_failure_policy` ("recompute" or "fail", vLLM's default), read
    from the config vLLM makes current while it builds a worker's connector; None where there is
    none (another release, or a caller outside vLLM's worker)."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    config = get_current_vllm_config_or_none()
    transfer = getattr(config, "kv_transfer_config", None)
    return getattr(transfer, "kv_load_failure_policy", None)
