"""Direct mode's staging <-> KV-cache copies: one `copy_` per run (the worker's) vs one `torch._foreach_copy_`.

    .nox/conformance-0-33-0/bin/python bench/direct_copy.py [--chunks 64] [--layers 64] [--reps 5]
    python3 bench/direct_copy.py --device cuda --chunks 512     # GPU host: torch only, no vLLM needed

Why: on the H200 (run 23, docs/direct-mode.md) a leased load spent its whole time in the worker's
copy thread: one `copy_` per (chunk, tensor) run, hundreds per 16 MiB chunk, and every `copy_`
releases and re-takes the GIL, which at TP=1 the worker shares with vLLM's scheduler loop. The
candidate: a batch's runs as one `torch._foreach_copy_`. Both are `memkv_vllm/direct/copies.py`
(`copy_runs`, the worker's, and `copy_runs_foreach`), loaded here from its file so that no vLLM
is needed: the GPU host image has torch but not vLLM.

What runs: KV tensors shaped like the 32B model's pages (`--layers` x K and V, 16-token pages of
`--page-kib`), a staging buffer of `--chunks` chunks, each chunk's runs as the worker builds them
(one run per tensor: 4 consecutive pages); per repetition, in alternating order, the copies
staging -> KV of every chunk with (a) the per-run loop and (b) the foreach call, each alone and
beside a thread that spins in Python
(the scheduler's loop with nothing to do). The KV tensors are compared with the staging bytes after
every copy. `--device cpu` (default): CPU tensors; `--device cuda`: KV tensors on the GPU, staging
pinned, copies `non_blocking` on a side stream and waited for, as the worker does.
Prints medians and the ratio loop / foreach per condition; writes bench/out/direct_copy.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
def load_copies():
    """memkv_vllm/direct/copies.py by its path: importing the package would import vLLM."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("memkv_direct_copies", ROOT / "src/memkv_vllm/direct/copies.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spinner(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():  # pure Python: holds the GIL until a forced switch
        x += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--page-kib", type=int, default=32, help="bytes of one 16-token page of one tensor (32B: 32 KiB)")
    ap.add_argument("--pages-per-chunk", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "direct_copy.json"))
    args = ap.parse_args()
    copies = load_copies()
    cuda = args.device == "cuda"
    page = args.page_kib << 10
    n_tensors = 2 * args.layers
    ppc = args.pages_per_chunk
    num_blocks = args.chunks * ppc
    tensors = [torch.zeros(num_blocks, page, dtype=torch.int8, device=args.device) for _ in range(n_tensors)]
    section = n_tensors * ppc * page
    staging = torch.randint(-128, 127, (args.chunks * section,), dtype=torch.int8)
    if cuda:
        staging = staging.pin_memory()
    runs = [(t, c * ppc, ppc, page, c * section + t * ppc * page) for c in range(args.chunks) for t in range(n_tensors)]
    stream = torch.cuda.Stream() if cuda else None

    def run_with(fn):
        def go(tensors_, staging_, runs_) -> None:
            if stream is None:
                fn(tensors_, staging_, runs_, False, False)
                return
            with torch.cuda.stream(stream):
                fn(tensors_, staging_, runs_, False, True)
                done = torch.cuda.Event()
                done.record(stream)
            done.synchronize()
        return go

    def check() -> None:
        for t in range(0, n_tensors, max(1, n_tensors // 8)):
            got = tensors[t].view(args.chunks, ppc * page).cpu()
            want = staging.view(args.chunks, n_tensors, ppc * page)[:, t]
            if not torch.equal(got, want):
                raise SystemExit(f"copy mismatch in tensor {t}")

    impls = {"loop": run_with(copies.copy_runs), "foreach": run_with(copies.copy_runs_foreach)}
    results: dict[str, list[float]] = {f"{i}/{c}": [] for c in ("alone", "busy") for i in impls}
    for rep in range(args.reps):
        order = list(impls) if rep % 2 == 0 else list(reversed(impls))
        for cond in ("alone", "busy"):
            for name in order:
                for t in tensors:
                    t.zero_()
                stop = threading.Event()
                spin = threading.Thread(target=spinner, args=(stop,), daemon=True) if cond == "busy" else None
                if spin:
                    spin.start()
                    time.sleep(0.01)
                t0 = time.perf_counter()
                impls[name](tensors, staging, runs)
                took = time.perf_counter() - t0
                stop.set()
                if spin:
                    spin.join()
                check()
                results[f"{name}/{cond}"].append(took)
    mib = args.chunks * section / 2**20
    print(f"{args.device}: {args.chunks} chunks x {n_tensors} runs of {ppc} x {args.page_kib} KiB ({mib:.0f} MiB), {args.reps} reps, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print("| condition | per-run copy_ loop | one _foreach_copy_ | loop / foreach (median of per-rep ratios) |")
    print("|---|---:|---:|---:|")
    summary = {}
    for cond in ("alone", "busy"):
        loop, fe = results[f"loop/{cond}"], results[f"foreach/{cond}"]
        ratio = statistics.median(a / b for a, b in zip(loop, fe))
        summary[cond] = {"loop_s": statistics.median(loop), "foreach_s": statistics.median(fe), "ratio": ratio}
        print(f"| {cond} | {summary[cond]['loop_s'] * 1e3:.1f} ms | {summary[cond]['foreach_s'] * 1e3:.1f} ms | {ratio:.2f}x |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "args": vars(args), "device": torch.cuda.get_device_name() if cuda else "cpu", "machine": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "load_avg": os.getloadavg(),
        "times_s": results, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
