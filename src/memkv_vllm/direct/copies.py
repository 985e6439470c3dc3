"""GPU blocks <-> staging copies of direct mode, by runs (imports torch only, so that
bench/direct_copy.py can time them on a host without vLLM).

A run is `(tensor idx, first block, blocks, page bytes, byte offset in staging)`: `blocks`
consecutive rows of KV tensor `tensor idx` (a `(num_blocks, >= page)` int8 view) and as many
consecutive `page`-byte pieces of staging (worker.py `_chunk_runs` builds them)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

Run = tuple[int, int, int, int, int]


def copy_runs(tensors: Sequence[torch.Tensor], staging: torch.Tensor, runs: Sequence[Run], to_staging: bool,
              non_blocking: bool) -> None:
    """One `copy_` per run (the worker's copy). `copy_runs_foreach` issues them as one
    `torch._foreach_copy_` instead: on the H200 the store direction's copies took 2.7x less time
    with it (run 24 vs run 23, two machines), but on the CPU box, beside a thread spinning in
    Python, it was 6-50x *slower* than this loop (bench/direct_copy.py, five quiet runs): its
    C++ loop appears to re-take the GIL per tensor. So this loop stays until the bench has run
    on the GPU (`--device cuda`; docs/direct-mode.md, run 24)."""
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
    Python). Not used by the worker: see `copy_runs`; bench/direct_copy.py times both."""
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
