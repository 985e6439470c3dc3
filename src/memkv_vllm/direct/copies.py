"""GPU blocks <-> staging copies of direct mode (imports torch only, so that
bench/direct_copy.py can time them on a host without vLLM). The worker uses `SectionCopier`.

A run is `(tensor idx, first block, blocks, page bytes, byte offset in staging)`: `blocks`
consecutive rows of KV tensor `tensor idx` (a `(num_blocks, >= page)` int8 view) and as many
consecutive `page`-byte pieces of staging (worker.py `_chunk_runs` builds them)."""

from __future__ import annotations

from collections.abc import Sequence
from math import gcd

import torch

Run = tuple[int, int, int, int, int]


def copy_runs(tensors: Sequence[torch.Tensor], staging: torch.Tensor, runs: Sequence[Run], to_staging: bool,
              non_blocking: bool) -> None:
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


def copy_runs_foreach(tensors: Sequence[torch.Tensor], staging: torch.Tensor, runs: Sequence[Run], to_staging: bool,
                      non_blocking: bool) -> None:
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

    def __init__(self, tensors: Sequence[torch.Tensor], staging: torch.Tensor, value_bytes: int,
                 scratch_chunks: int, pages: Sequence[int] = ()) -> None:
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
