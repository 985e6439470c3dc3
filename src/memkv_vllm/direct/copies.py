"""GPU blocks <-> staging copies of direct mode (imports torch and numpy only, so that
bench/direct_copy.py can time them on a host without vLLM). The worker uses `SectionCopier` or
`PieceCopier` (`memkv.copy_method`).

A run is `(tensor idx, first block, blocks, page bytes, byte offset in staging)`: `blocks`
consecutive rows of KV tensor `tensor idx` (a `(num_blocks, >= page)` int8 view) and as many
consecutive `page`-byte pieces of staging. `chunk_runs` builds a job's runs, one int64 array of
shape (runs, 5) per chunk, with numpy: a 32k job has tens of thousands of runs, and a Python
loop over them holds the GIL the worker shares with vLLM's scheduler loop."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from math import gcd
from typing import NamedTuple

import numpy as np
import torch

try:
    from memkv_vllm import _copy_pieces
except ImportError:  # not built (no C compiler at install): the worker copies through its scratch
    _copy_pieces = None  # type: ignore[assignment]

Run = tuple[int, int, int, int, int]
RunArray = np.ndarray  # int64, shape (runs, 5): one Run per row
Runs = Sequence[Run] | RunArray

log = logging.getLogger(__name__)


def chunk_runs(
    block_ids: Sequence[int] | np.ndarray,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    groups: Sequence[Sequence[tuple[int, int, int]]],
    blocks_per_chunk: int,
    n_chunks: int,
) -> list[RunArray]:
    """Per chunk of a job, its runs (offsets inside the chunk's section) as an int64 array of
    shape (runs, 5): consecutive GPU blocks that are consecutive sub-blocks of one chunk are one
    run per layer, in block order, each block's layers in `groups[g]` order.

    `block_ids`: the job's GPU blocks, KV group after KV group (`group_sizes` of them each);
    `block_indices[g]`: the position in the prompt of group g's first block; `groups[g]`: the
    group's layers as (tensor idx, page bytes, offset of its pages in a section). vLLM's rule
    (vllm-spec-api.md 5.3): with `skip = block_indices[g] % blocks_per_chunk`, the group's block j
    is sub-block `(skip + j) % bpc` of its chunk `(skip + j) // bpc`, and the group takes
    `ceil((n + skip) / bpc)` of the job's chunks."""
    bpc = blocks_per_chunk
    ids_all = np.asarray(block_ids, dtype=np.int64)
    parts: list[np.ndarray] = []  # per group: (chunk of the job, run) rows
    pos = 0  # the group's first GPU block in block_ids
    key = 0  # the group's first chunk
    for g, n in enumerate(group_sizes):
        n = int(n)
        if n == 0:
            continue
        skip = int(block_indices[g]) % bpc
        ids = ids_all[pos : pos + n]
        if len(ids) != n:
            raise AssertionError(
                f"MemKV direct mode: a job's group sizes name {pos + n} GPU block(s), it has {len(ids_all)}"
            )
        place = skip + np.arange(n, dtype=np.int64)
        chunk, sub = place // bpc, place % bpc
        start = np.ones(n, dtype=bool)  # a run starts at a new chunk or where the block ids jump
        start[1:] = (sub[1:] == 0) | (ids[1:] != ids[:-1] + 1)
        first = np.flatnonzero(start)
        length = np.diff(np.append(first, n))
        if key + int(chunk[-1]) >= n_chunks:
            raise AssertionError(f"MemKV direct mode: a job names {n_chunks} chunk(s) but its GPU blocks cover more")
        entries = np.asarray(groups[g], dtype=np.int64).reshape(-1, 3)  # (tensor idx, page, offset)
        m = len(entries)
        rows = np.empty((len(first) * m, 6), dtype=np.int64)
        rows[:, 0] = np.repeat(key + chunk[first], m)
        rows[:, 1] = np.tile(entries[:, 0], len(first))
        rows[:, 2] = np.repeat(ids[first], m)
        rows[:, 3] = np.repeat(length, m)
        rows[:, 4] = np.tile(entries[:, 1], len(first))
        rows[:, 5] = np.tile(entries[:, 2], len(first)) + np.repeat(sub[first], m) * rows[:, 4]
        parts.append(rows)
        pos += n
        key += -(-(n + skip) // bpc)
    if key != n_chunks:
        raise AssertionError(f"MemKV direct mode: a job names {n_chunks} chunk(s) but its GPU blocks cover {key}")
    if not parts:
        return [np.empty((0, 5), dtype=np.int64) for _ in range(n_chunks)]
    rows = np.concatenate(parts)  # chunk numbers never decrease: groups take consecutive chunks
    bounds = np.searchsorted(rows[:, 0], np.arange(1, n_chunks))
    return np.split(rows[:, 1:], bounds)


def run_bytes(runs: Runs) -> int:
    """The bytes `runs` move."""
    if isinstance(runs, np.ndarray):
        return int((runs[:, 2] * runs[:, 3]).sum())
    return sum(n * page for _, _, n, page, _ in runs)


def as_tuples(runs: Runs) -> Sequence[Run]:
    """`runs` as Python tuples of ints, for the copiers that loop over them in Python."""
    return [tuple(r) for r in runs.tolist()] if isinstance(runs, np.ndarray) else runs  # type: ignore[misc]


def copy_runs(
    tensors: Sequence[torch.Tensor], staging: torch.Tensor, runs: Sequence[Run], to_staging: bool, non_blocking: bool
) -> None:
    """One `copy_` per run: the worker's copy with `copy_scratch_mb` 0, and the reference the
    tests hold `SectionCopier` to. On the H200 it is 3-10x slower than `SectionCopier` (run 25,
    docs/direct-mode.md): its cost is per run, hundreds per chunk."""
    for tensor_idx, block, length, page, offset in runs:
        gpu = tensors[tensor_idx][block : block + length, :page]
        host = staging[offset : offset + length * page].view(length, page)
        if to_staging:
            host.copy_(gpu, non_blocking=non_blocking)
        else:
            gpu.copy_(host, non_blocking=non_blocking)


def copy_runs_foreach(
    tensors: Sequence[torch.Tensor], staging: torch.Tensor, runs: Sequence[Run], to_staging: bool, non_blocking: bool
) -> None:
    """All `runs` in one `torch._foreach_copy_` call (the views are still built one by one in
    Python). Not used by the worker: 0.7-0.85x the per-run loop on the H200 (run 25) and far
    slower beside a busy thread on the CPU box; kept so that bench/direct_copy.py can show it."""
    gpus, hosts = [], []
    for tensor_idx, block, length, page, offset in runs:
        gpus.append(tensors[tensor_idx][block : block + length, :page])
        hosts.append(staging[offset : offset + length * page].view(length, page))
    if not gpus:
        return
    if to_staging:
        torch._foreach_copy_(hosts, gpus, non_blocking=non_blocking)
    else:
        torch._foreach_copy_(gpus, hosts, non_blocking=non_blocking)


class SectionCopier:
    """Copies whole chunk sections through a scratch buffer on the KV tensors' device, so that a
    batch costs one host <-> device copy per chunk plus one gather and one scatter per KV tensor,
    instead of one host <-> device `copy_` per (chunk, tensor) run (`copy_runs`).

    Why: on the H200 a leased load spent its time issuing `copy_` calls (run 23: 128 of them per
    16 MiB chunk for the 32B shape, ~175 us each beside vLLM's scheduler loop, which shares the
    GIL with the copy thread at TP=1). Here the per-tensor work is `index_select` + `index_copy_`
    between the scratch and the KV tensor, so the number of calls does not grow with the chunks
    in the batch (run 25: 3-10x faster than `copy_runs` on the H200); a batch larger than the
    scratch goes through it in parts, in stream order. (One `index_put_` per tensor from a
    strided view of the scratch, saving the gather's call, was no faster in the engine: run 28.)

    `sections` are `(staging byte offset of the chunk's section, runs)` with each run's byte
    offset relative to the section. A run whose scratch position is not a multiple of its page
    (mixed page sizes) is copied by itself, device to device. `pages`: the runs' page sizes (the
    scratch's chunk stride is a multiple of each). Memory: `scratch_chunks` chunks of `stride`
    bytes on the device, allocated at the first copy and kept."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        staging: torch.Tensor,
        value_bytes: int,
        scratch_chunks: int,
        pages: Sequence[int] = (),
    ) -> None:
        self.tensors = list(tensors)
        self.staging = staging
        self.value_bytes = value_bytes
        self.scratch_chunks = max(1, scratch_chunks)
        align = 1  # rows of every page size line up when the chunk stride is a multiple of each
        for p in set(pages) or {int(t.shape[1]) for t in self.tensors}:
            align = align * p // gcd(align, p)
        self.stride = -(-value_bytes // align) * align if align <= value_bytes else value_bytes
        self.device = self.tensors[0].device if self.tensors else torch.device("cpu")
        self._scratch: torch.Tensor | None = None
        # Views that never change, built once: each torch call re-takes the GIL, which the copy
        # thread shares with vLLM's scheduler loop (the cost this class exists to cut).
        self._kv_rows: dict[tuple[int, int], torch.Tensor] = {}  # (tensor, page) -> its blocks as rows
        self._scratch_rows: dict[int, torch.Tensor] = {}  # page -> the scratch as rows of that page

    @property
    def scratch_bytes(self) -> int:
        return self.scratch_chunks * self.stride

    def copy(self, sections: Sequence[tuple[int, Sequence[Run]]], to_staging: bool, non_blocking: bool) -> None:
        cap = self.scratch_chunks
        for lo in range(0, len(sections), cap):
            self._copy_part(sections[lo : lo + cap], to_staging, non_blocking)

    def _copy_part(self, part: Sequence[tuple[int, Sequence[Run]]], to_staging: bool, non_blocking: bool) -> None:
        if self._scratch is None:
            self._scratch = torch.zeros(self.scratch_bytes, dtype=torch.int8, device=self.device)
        flat, stride, vb = self._scratch, self.stride, self.value_bytes
        per_tensor: dict[tuple[int, int], tuple[list[int], list[int]]] = {}  # (tensor, page) -> (blocks, rows)
        loose: list[Run] = []  # (tensor, block, blocks, page, scratch byte offset)
        for k, (_, runs) in enumerate(part):
            for tensor_idx, block, length, page, offset in runs:
                pos = k * stride + offset
                if pos % page:
                    loose.append((tensor_idx, block, length, page, pos))
                    continue
                blocks, rows = per_tensor.setdefault((tensor_idx, page), ([], []))
                blocks.extend(range(block, block + length))
                rows.extend(range(pos // page, pos // page + length))
        if not to_staging:
            for k, (base, _) in enumerate(part):
                flat[k * stride : k * stride + vb].copy_(self.staging[base : base + vb], non_blocking=non_blocking)
        if per_tensor:
            flat_ids: list[int] = []
            for blocks, rows in per_tensor.values():
                flat_ids += blocks
                flat_ids += rows
            ids = torch.tensor(flat_ids, dtype=torch.int64)
            if ids.device != self.device:
                ids = ids.to(self.device, non_blocking=non_blocking)
            pieces = ids.split([len(blocks) for blocks, _ in per_tensor.values() for _ in (0, 1)])
            for i, (tensor_idx, page) in enumerate(per_tensor):
                block_ids, row_ids = pieces[2 * i], pieces[2 * i + 1]
                kv = self._kv_rows.get((tensor_idx, page))
                if kv is None:
                    kv = self._kv_rows[(tensor_idx, page)] = _wide(self.tensors[tensor_idx][:, :page])
                rows = self._scratch_rows.get(page)
                if rows is None:
                    rows = self._scratch_rows[page] = _wide(flat[: flat.numel() // page * page].view(-1, page))
                if to_staging:
                    rows.index_copy_(0, row_ids, kv.index_select(0, block_ids))
                else:
                    kv.index_copy_(0, block_ids, rows.index_select(0, row_ids))
        for tensor_idx, block, length, page, pos in loose:
            kv = self.tensors[tensor_idx][block : block + length, :page]
            scratch = flat[pos : pos + length * page].view(length, page)
            if to_staging:
                scratch.copy_(kv)
            else:
                kv.copy_(scratch)
        if to_staging:
            for k, (base, _) in enumerate(part):
                self.staging[base : base + vb].copy_(flat[k * stride : k * stride + vb], non_blocking=non_blocking)


def _wide(rows: torch.Tensor) -> torch.Tensor:
    """`rows` (int8, last dim contiguous) as int64 where its size and alignment allow: index
    kernels move one element per thread (GPU) or per step (CPU), so 8x fewer of them."""
    if rows.shape[-1] % 8 == 0 and rows.stride(0) % 8 == 0 and rows.data_ptr() % 8 == 0:
        return rows.view(torch.int64)
    return rows


CUDA_MEMCPY_HOST_TO_DEVICE, CUDA_MEMCPY_DEVICE_TO_HOST = 1, 2  # cudaMemcpyKind


class PiecesUnavailable(RuntimeError):
    """PieceCopier cannot run here (the reason is the message): the worker uses SectionCopier."""


class CudaRuntime(NamedTuple):
    """The copy entry points of the CUDA runtime this process loaded (addresses)."""

    memcpy_async: int  # cudaMemcpyAsync
    memcpy_batch_async: int  # cudaMemcpyBatchAsync (CUDA 12.8+), 0 where this runtime has none
    version: int  # cudaRuntimeGetVersion: 13000 for 13.0 (the batch call's signature depends on it)


def cuda_runtime() -> CudaRuntime | None:
    """The CUDA runtime this process loaded (torch's, so that its streams and device pointers are
    the runtime's own); None where none is loaded as a shared library (a runtime linked statically
    into torch)."""
    paths = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "/libcudart.so" in fields[5]:
                paths.add(fields[5].strip())
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # dlopen of a loaded library: the same runtime
            memcpy_async = ctypes.cast(lib.cudaMemcpyAsync, ctypes.c_void_p).value
            version = ctypes.c_int(0)
            if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
                continue
        except (OSError, AttributeError):
            continue
        batch = getattr(lib, "cudaMemcpyBatchAsync", None) if version.value >= 12080 else None
        return CudaRuntime(
            memcpy_async or 0, ctypes.cast(batch, ctypes.c_void_p).value or 0 if batch else 0, version.value
        )
    return None


class PieceCopier:
    """Copies a batch as (destination, source, bytes) pieces issued by ONE call into C with the
    GIL released (memkv_vllm._copy_pieces): on CUDA one `cudaMemcpyBatchAsync` for the whole batch
    on the current stream where the runtime has it (12.8+), else one cudaMemcpyAsync per piece
    (staging is pinned: host-registered by the worker); on CPU one memcpy per piece.

    A piece is a run (`copy_runs`' unit): its `blocks` rows of one KV tensor, one piece when
    those rows are contiguous (row stride == page), else one per row. The pieces are computed
    with numpy from the chunks' run arrays (`chunk_runs`), so a batch costs a bounded number of
    Python-level calls, however many runs it has: the per-run cost is in C without the GIL,
    which the worker shares with vLLM's scheduler loop at TP=1 (SectionCopier still makes two
    torch calls per KV tensor per batch). Every piece
    is checked against its tensor's rows and the staging buffer before anything is copied.

    `batch`: None uses the batched call where the runtime has it, False never (bench/direct_copy.py
    compares the two). Where a batched call fails, that batch is copied piece by piece, a WARNING
    names the error, and the copier copies piece by piece from then on.

    Raises PiecesUnavailable where it cannot run: the module is not built, a KV tensor is not a
    2-D int8 view with contiguous rows, or the CUDA runtime is not loaded as a shared library."""

    def __init__(self, tensors: Sequence[torch.Tensor], staging: torch.Tensor, batch: bool | None = None) -> None:
        if _copy_pieces is None:
            raise PiecesUnavailable("memkv_vllm._copy_pieces is not built (no C compiler at install)")
        for i, t in enumerate(tensors):
            if t.dim() != 2 or t.dtype != torch.int8 or t.stride(1) != 1:
                raise PiecesUnavailable(
                    f"KV tensor {i} is not a 2-D int8 view with contiguous rows "
                    f"({tuple(t.shape)}, {t.dtype}, strides {t.stride()})"
                )
        self.cuda = bool(tensors) and tensors[0].is_cuda
        self._runtime = CudaRuntime(0, 0, 0)  # memcpy, no batched call: CPU tensors
        if self.cuda:
            runtime = cuda_runtime()
            if runtime is None:
                raise PiecesUnavailable("no CUDA runtime loaded as a shared library (libcudart.so)")
            self._runtime = runtime if batch is not False else runtime._replace(memcpy_batch_async=0)
        self._device = tensors[0].device.index or 0 if self.cuda else 0
        self._base = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
        self._stride = np.array([t.stride(0) for t in tensors], dtype=np.int64)
        self._rows = np.array([t.shape[0] for t in tensors], dtype=np.int64)
        self._width = np.array([t.shape[1] for t in tensors], dtype=np.int64)
        self._staging = int(staging.data_ptr())
        self._staging_bytes = staging.numel() * staging.element_size()
        self._keep = (list(tensors), staging)  # the pointers above stay valid while we hold these

    @property
    def batched(self) -> bool:
        """Whether a batch goes to the GPU as one cudaMemcpyBatchAsync."""
        return bool(self._runtime.memcpy_batch_async)

    def copy(self, sections: Sequence[tuple[int, Runs]], to_staging: bool, non_blocking: bool) -> None:
        parts = [np.asarray(rs, dtype=np.int64).reshape(-1, 5) for _, rs in sections]
        if not parts:
            return
        runs = np.concatenate(parts)  # a copy: the sections' arrays stay as they are
        if not len(runs):
            return
        runs[:, 4] += np.repeat(np.array([base for base, _ in sections], dtype=np.int64), [len(r) for r in parts])
        t, block, blocks, page, offset = runs.T
        if ((t < 0) | (t >= len(self._base))).any():
            raise ValueError("PieceCopier: a run names a KV tensor that does not exist")
        if (
            (block < 0)
            | (blocks < 1)
            | (block + blocks > self._rows[t])
            | (page < 1)
            | (page > self._width[t])
            | (offset < 0)
            | (offset + blocks * page > self._staging_bytes)
        ).any():
            raise ValueError("PieceCopier: a run lies outside its KV tensor's rows or the staging buffer")
        stride = self._stride[t]
        whole = (stride == page) | (blocks == 1)  # its rows are one contiguous piece
        count = np.where(whole, 1, blocks)
        run_of = np.repeat(np.arange(len(runs)), count)
        row = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)  # row within its run
        size = np.where(whole, blocks * page, page)[run_of]
        device = self._base[t][run_of] + (block[run_of] + row) * stride[run_of]
        host = self._staging + offset[run_of] + row * page[run_of]
        dst, src = (host, device) if to_staging else (device, host)
        kind = CUDA_MEMCPY_DEVICE_TO_HOST if to_staging else CUDA_MEMCPY_HOST_TO_DEVICE
        stream = torch.cuda.current_stream().cuda_stream if self.cuda else 0
        rt = self._runtime
        failed = _copy_pieces.copy_pieces(
            rt.memcpy_async,
            kind,
            stream,
            dst.astype(np.uint64),
            src.astype(np.uint64),
            size.astype(np.uint64),
            rt.memcpy_batch_async,
            rt.version,
            self._device,
        )
        if failed:
            log.warning(
                "MemKV direct mode: cudaMemcpyBatchAsync failed with CUDA error %d (runtime %d); this batch "
                "and the next are copied one cudaMemcpyAsync per piece",
                failed,
                rt.version,
            )
            self._runtime = rt._replace(memcpy_batch_async=0)
        if self.cuda and not non_blocking:
            torch.cuda.current_stream().synchronize()
