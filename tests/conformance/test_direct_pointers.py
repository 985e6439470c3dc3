"""Direct mode's worker with the GPU side of a job as each vLLM release hands it over.

vLLM 0.34 resolves a job's GPU blocks into `DevicePointers` (`pointer_utils.
resolve_device_pointers`: flat per-group, per-layer, per-block pointer and size arrays) before
calling the worker; 0.25-0.33 pass the `GPULoadStoreSpec` of block ids. Here vLLM's own classes
build the job (`GPULoadStoreSpec`, `CanonicalKVCaches`, and on 0.34 the real resolver) over the
KV layouts vLLM's connector registers: one int8 tensor per layer whose rows are exactly a page
(layer-outermost), and layers interleaved inside one block row (packed: a row stride larger than
the page). Asserted, for several KV groups with different page sizes, scattered GPU blocks, a
first block that is not chunk-aligned, TP=1 and TP=2 (one worker per rank, one staging region):

* `compat.gpu_blocks` returns exactly the job's block ids, group sizes and block indices;
* a store job and then a load job into other scattered blocks (load_guarantee "staged": copies
  only, no MemKV node) bring back every byte of every layer of every block, on every rank, and
  write nothing into blocks outside the load job;
* 0.34: pointers that do not address whole rows of the worker's tensors are refused with a
  RuntimeError (never a copy into some other row);
* 0.34: a worker built under kv_load_failure_policy "fail" (vLLM's default) logs one WARNING
  naming "recompute"; under "recompute" none.

CPU tensors stand in for the GPU. With vLLM 0.34's extensible KV cache (GPU virtual memory, the
default on CUDA) the registered tensors are views over the committed part of a reserved range,
with the same rows and strides as here; only a GPU run exercises that memory itself.
"""

from __future__ import annotations

import logging
import os
import random
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec

from memkv_vllm import compat
from memkv_vllm.direct.config import DirectSettings
from memkv_vllm.direct.layout import MemKVLoadStoreSpec, StagingLayout
from memkv_vllm.direct.staging import PAGE_BYTES, round_up
from memkv_vllm.direct.worker import MemKVDirectWorker
from tests.conformance import direct_harness as dh
from tests.conformance import harness_compat as hc

pytestmark = pytest.mark.conformance

NUM_BLOCKS = 64
BPC = 4  # GPU blocks per chunk
GROUP_PAGES = [[256, 256], [96]]  # per KV group, per layer: page bytes (two groups, different page sizes)


def _kv_caches(packed: bool, seed: int) -> CanonicalKVCaches:
    """Random KV in vLLM's canonical form. Packed: one buffer, every layer's page side by side in
    a block row, each layer's tensor a strided view of it (as register_kv_caches builds for
    packed layouts); otherwise one tensor per layer, row == page."""
    gen = torch.Generator().manual_seed(seed)
    pages = [p for group in GROUP_PAGES for p in group]
    if packed:
        row = sum(pages) + 32  # padding at the end of a row, as a packed layout may have
        buf = torch.randint(-128, 127, (NUM_BLOCKS, row), dtype=torch.int8, generator=gen)
        tensors, offset = [], 0
        for p in pages:
            tensors.append(buf[:, offset : offset + p])
            offset += p
    else:
        tensors = [torch.randint(-128, 127, (NUM_BLOCKS, p), dtype=torch.int8, generator=gen) for p in pages]
    canonical = [
        hc.fill_dataclass(CanonicalKVCacheTensor, {"tensor": t, "page_size_bytes": t.shape[1]}) for t in tensors
    ]
    refs, idx = [], 0
    for group in GROUP_PAGES:
        refs.append(
            [
                hc.fill_dataclass(CanonicalKVCacheRef, {"tensor_idx": idx + i, "page_size_bytes": p})
                for i, p in enumerate(group)
            ]
        )
        idx += len(group)
    return CanonicalKVCaches(tensors=canonical, group_data_refs=refs)


def _job(rng: random.Random, sizes: list[int], indices: list[int]) -> GPULoadStoreSpec:
    """Scattered, distinct block ids per group (block 0 is vLLM's null block: never used)."""
    ids = rng.sample(range(1, NUM_BLOCKS), sum(sizes))
    return GPULoadStoreSpec(ids, sizes, indices)


def _n_chunks(sizes: list[int], indices: list[int]) -> int:
    return sum(-(-(n + i % BPC) // BPC) for n, i in zip(sizes, indices) if n)


def _layout(rank: int, world_size: int, num_slots: int, path: str) -> StagingLayout:
    value = max(BPC * sum(group) for group in GROUP_PAGES)
    return StagingLayout(rank, world_size, BPC, value, round_up(value, PAGE_BYTES), num_slots, path)


def _rows(kv: CanonicalKVCaches, job: GPULoadStoreSpec) -> list[bytes]:
    """The job's bytes in logical order: per group, per layer, per block."""
    out, pos = [], 0
    ids = [int(b) for b in job.block_ids]
    for n, refs in zip(job.group_sizes, kv.group_data_refs):
        for ref in refs:
            t = kv.tensors[ref.tensor_idx].tensor
            out += [t[b].numpy().tobytes() for b in ids[pos : pos + n]]
        pos += n
    return out


@pytest.mark.parametrize("copy_method", ["scratch", "pieces"])
@pytest.mark.parametrize("packed", [False, True], ids=["layer-outermost", "packed"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_store_then_load_into_other_scattered_blocks_is_byte_exact_in_every_group_and_rank(
    packed, world_size, copy_method
):
    rng = random.Random(f"{packed}/{world_size}")
    sizes, indices = [7, 5], [2, 0]  # group 0 starts mid-chunk: its first chunk skips 2 sub-blocks
    n_chunks = _n_chunks(sizes, indices)
    path = os.path.join("/dev/shm", f"memkv_test_pointers_{uuid.uuid4().hex}.staging")
    settings = DirectSettings(load_guarantee="staged", copy_method=copy_method)
    caches = [_kv_caches(packed, seed=10 * rank + 1) for rank in range(world_size)]
    workers = [
        MemKVDirectWorker(caches[rank], _layout(rank, world_size, n_chunks, path), settings)
        for rank in range(world_size)
    ]
    try:
        assert all((w._pieces is not None) == (copy_method == "pieces") for w in workers), "the copier asked for"
        store, load = _job(rng, sizes, indices), _job(rng, sizes, indices)
        slots = MemKVLoadStoreSpec(list(range(n_chunks)))
        stored = [_rows(kv, store) for kv in caches]
        for worker, kv in zip(workers, caches):
            arg = dh.worker_gpu_arg(store, kv)
            assert hasattr(arg, "ptrs") == compat.HAS_DEVICE_POINTERS
            blocks = compat.gpu_blocks(arg, kv)
            assert blocks.block_ids == [int(b) for b in store.block_ids]
            assert (blocks.group_sizes, blocks.block_indices) == (sizes, indices)
            assert worker.submit_store(1, arg, slots)
        for rank, kv in enumerate(caches):  # the load's blocks and every other block get new bytes
            untouched = {}
            for ct in kv.tensors:
                ct.tensor.copy_(torch.randint(-128, 127, ct.tensor.shape, dtype=torch.int8))
            for i, ct in enumerate(kv.tensors):
                untouched[i] = ct.tensor.clone()
            assert workers[rank].submit_load(2, slots, dh.worker_gpu_arg(load, kv))
            assert [(r.job_id, r.success) for r in workers[rank].get_finished()] == [(1, True), (2, True)]
            assert _rows(kv, load) == stored[rank], f"rank {rank}: loaded bytes differ from the stored ones"
            loaded = {int(b) for b in load.block_ids}
            for i, ct in enumerate(kv.tensors):
                for b in range(NUM_BLOCKS):
                    if b not in loaded:
                        assert torch.equal(ct.tensor[b], untouched[i][b]), f"rank {rank}: block {b} written"
        if world_size == 2:
            assert stored[0] != stored[1]  # each rank moved its own bytes, through its own section
    finally:
        for worker in workers:
            worker.shutdown()
        if os.path.exists(path):
            os.unlink(path)


@pytest.mark.skipif(not compat.HAS_DEVICE_POINTERS, reason="DevicePointers exist from vLLM 0.34")
@pytest.mark.parametrize("damage", ["offset inside a row", "another tensor", "size", "past the last block"])
def test_pointers_that_do_not_address_whole_rows_are_refused(damage):
    kv = _kv_caches(packed=True, seed=3)
    arg = dh.worker_gpu_arg(GPULoadStoreSpec([3, 9, 4, 20], [3, 1], [0, 0]), kv)
    ptrs, sizes = arg.ptrs.copy(), arg.sizes.copy()
    t0 = kv.tensors[0].tensor
    if damage == "offset inside a row":
        ptrs[1] += np.uint64(8)
    elif damage == "another tensor":  # group 0 layer 0's pointer into layer 1's tensor
        ptrs[0] = np.uint64(kv.tensors[1].tensor.data_ptr() + 3 * kv.tensors[1].tensor.stride(0))
    elif damage == "size":
        sizes[0] -= np.uint64(1)
    else:
        ptrs[2] = np.uint64(t0.data_ptr() + NUM_BLOCKS * t0.stride(0))
    bad = type(arg)(
        ptrs=ptrs,
        sizes=sizes,
        group_block_counts=arg.group_block_counts,
        group_data_ref_counts=arg.group_data_ref_counts,
        block_indices=arg.block_indices,
    )
    with pytest.raises(RuntimeError, match="DevicePointers"):
        compat.gpu_blocks(bad, kv)


@pytest.mark.skipif(not compat.load_failure_reportable(), reason="vLLM 0.34+: kv_load_failure_policy")
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_the_worker_warns_once_when_a_failed_load_would_end_the_request(monkeypatch, caplog, policy):
    """vLLM builds a worker's connector with its config made current: under vLLM's default
    kv_load_failure_policy "fail" a load MemKV cannot complete ends the request with an error, so
    the worker says how to have it recomputed; under "recompute" it says nothing."""
    import vllm.config

    current = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_load_failure_policy=policy))
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: current)
    path = os.path.join("/dev/shm", f"memkv_test_policy_{uuid.uuid4().hex}.staging")
    with caplog.at_level(logging.WARNING, logger="vllm.memkv_vllm"):
        worker = MemKVDirectWorker(
            _kv_caches(packed=False, seed=5), _layout(0, 1, 2, path), DirectSettings(load_guarantee="staged")
        )
    try:
        warned = [r.getMessage() for r in caplog.records if "kv_load_failure_policy" in r.getMessage()]
        if policy == "fail":
            assert len(warned) == 1 and '"kv_load_failure_policy": "recompute"' in warned[0]
        else:
            assert warned == []
    finally:
        worker.shutdown()
        if os.path.exists(path):
            os.unlink(path)
