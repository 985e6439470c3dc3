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
    """All `runs` in one `torch._foreach_copy_` call: its loop of copies runs in C++ with the
    GIL released once. A copy_ per run released and re-took the GIL for each of the hundreds of
    runs per chunk; beside vLLM's scheduler loop (same process at TP=1) every re-take could
    wait behind it: the leased load's copy thread was its bottleneck on the H200
    (docs/direct-mode.md, run 23). The views are still built one by one in Python."""
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


def copy_runs_one_by_one(tensors: Sequence[torch.Tensor], staging: torch.Tensor, runs: Sequence[Run],
                         to_staging: bool, non_blocking: bool) -> None:
    """The copy before 711425d, one `copy_` per run: bench/direct_copy.py's baseline."""
    for tensor_idx, block, length, page, offset in runs:
        gpu = tensors[tensor_idx][block : block + length, :page]
        host = staging[offset : offset + length * page].view(length, page)
        if to_staging:
            host.copy_(gpu, non_blocking=non_blocking)
        else:
            gpu.copy_(host, non_blocking=non_blocking)
