"""Direct mode's staging <-> KV-cache copies: the worker's `SectionCopier` and `PieceCopier` vs one `copy_` per run vs one `torch._foreach_copy_`.

    .nox/conformance-0-33-0/bin/python bench/direct_copy.py [--chunks 64] [--layers 64] [--reps 5]
    python3 bench/direct_copy.py --device cuda --chunks 512     # GPU host: torch only, no vLLM needed

Why: on the H200 (run 23, docs/archive/direct-mode-runs.md) a leased load spent its whole time in the worker's
copy thread, then issuing one `copy_` per (chunk, tensor) run, hundreds per 16 MiB chunk, each
re-taking the GIL that at TP=1 the worker shares with vLLM's scheduler loop. This compares the
per-run loop (`copy_runs`), one `_foreach_copy_` for all runs (`copy_runs_foreach`) and the
worker's copy since run 26 (`SectionCopier`) and `PieceCopier` (copy_method "pieces": every run as
one piece of a cudaMemcpyBatchAsync where the CUDA runtime has it, also timed as one
cudaMemcpyAsync per piece ("pieces-loop"), or memcpy on the CPU, all issued by one call into C
without the GIL; "pieces-tuples" is the same copier handed each chunk's runs as Python tuples
instead of the worker's int64 arrays (`chunk_runs`); needs
`memkv_vllm._copy_pieces` built, `python3 setup.py build_ext --inplace`), all from
`memkv_vllm/direct/copies.py`, loaded here from its file so that no vLLM is needed: the GPU host
image has torch but not vLLM.

What runs: KV tensors shaped like the 32B model's pages (`--layers` x K and V, 16-token pages of
`--page-kib`), a staging buffer of `--chunks` chunks, each chunk's runs as the worker builds them
(`chunk_runs`, the worker's own builder: one run per tensor of 4 consecutive pages, or one per
page with `--shuffle`); per repetition, in
alternating order, each implementation alone and beside a thread that spins in Python (the
scheduler's loop with nothing to do). The KV tensors are compared with the staging bytes after
every copy. `--device cpu` (default): CPU tensors; `--device cuda`: KV tensors on the GPU, staging
pinned, copies `non_blocking` on a side stream and waited for, as the worker does.
`SectionCopier` (one host <-> device copy per chunk into a device scratch, then one gather + one
scatter per KV tensor) runs once per `--scratch-chunks`.
Both directions: "load" (staging -> KV) and "store" (KV -> staging, checked against the bytes).
Prints medians and the ratio loop / each other per condition; writes bench/out/direct_copy.json.
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
    import sys

    sys.path.insert(0, str(ROOT / "src"))  # memkv_vllm._copy_pieces (its package imports no vLLM)
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
    ap.add_argument(
        "--scratch-chunks",
        type=int,
        nargs="*",
        default=[4, 16],
        help="SectionCopier variants to time: chunks its scratch holds",
    )
    ap.add_argument(
        "--staging",
        default="pinned",
        choices=("pinned", "shm"),
        help="pinned: torch's pinned allocation; shm: a mapped /dev/shm file host-registered, as direct mode's worker",
    )
    ap.add_argument("--shuffle", action="store_true", help="permute the GPU blocks: one run per page")
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
    want = torch.randint(-128, 127, (args.chunks * section,), dtype=torch.int8)
    if args.staging == "shm":  # as the worker: a /dev/shm file mapped, then host-registered (pinned) on CUDA
        import mmap

        fd = os.open(f"/dev/shm/direct_copy_bench_{os.getpid()}", os.O_RDWR | os.O_CREAT, 0o600)
        os.unlink(f"/dev/shm/direct_copy_bench_{os.getpid()}")
        os.ftruncate(fd, want.numel())
        staging = torch.frombuffer(mmap.mmap(fd, want.numel()), dtype=torch.int8)
        staging.copy_(want)
        if cuda and torch.cuda.cudart().cudaHostRegister(staging.data_ptr(), want.numel(), 0).value != 0:
            raise SystemExit("cudaHostRegister of the /dev/shm staging failed")
    else:
        staging = want.clone().pin_memory() if cuda else want.clone()
    blocks = torch.arange(num_blocks)
    if args.shuffle:  # blocks of a long-lived engine: no two consecutive, one run per page
        blocks = blocks[torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))]
    # The worker's own run builder: one KV group whose layers are the tensors, each chunk's pages
    # of tensor t at t * ppc * page in its section.
    group = [(t, page, t * ppc * page) for t in range(n_tensors)]
    rel_arrays = copies.chunk_runs(blocks.tolist(), [num_blocks], [0], [group], ppc, args.chunks)
    rel = [copies.as_tuples(r) for r in rel_arrays]
    runs = [(t, b, n, p, c * section + off) for c in range(args.chunks) for t, b, n, p, off in rel[c]]
    sections = [(c * section, rel_arrays[c]) for c in range(args.chunks)]  # as the worker hands them over
    tuple_sections = [(c * section, rel[c]) for c in range(args.chunks)]
    stream = torch.cuda.Stream() if cuda else None

    def on_stream(fn):
        def go() -> None:
            if stream is None:
                fn(False)
                return
            with torch.cuda.stream(stream):
                fn(True)
                done = torch.cuda.Event()
                done.record(stream)
            done.synchronize()

        return go

    def check(to_staging: bool) -> None:
        if to_staging:
            if not torch.equal(staging, want):
                raise SystemExit("store: staging differs from the KV bytes")
            return
        for t in range(0, n_tensors, max(1, n_tensors // 8)):
            got = tensors[t][blocks].view(args.chunks, ppc * page).cpu()
            if not torch.equal(got, want.view(args.chunks, n_tensors, ppc * page)[:, t]):
                raise SystemExit(f"load: copy mismatch in tensor {t}")

    impls = {
        "loop": lambda s: on_stream(lambda nb: copies.copy_runs(tensors, staging, runs, s, nb)),
        "foreach": lambda s: on_stream(lambda nb: copies.copy_runs_foreach(tensors, staging, runs, s, nb)),
    }
    if copies._copy_pieces is not None:
        pieces = copies.PieceCopier(tensors, staging)
        impls["pieces"] = lambda s: on_stream(lambda nb: pieces.copy(sections, s, nb))
        # The same copier handed Python tuples (the worker's runs before they were arrays).
        impls["pieces-tuples"] = lambda s: on_stream(lambda nb: pieces.copy(tuple_sections, s, nb))
        if pieces.batched:  # the default where the runtime has cudaMemcpyBatchAsync: its loop beside it
            pieces_loop = copies.PieceCopier(tensors, staging, batch=False)
            impls["pieces-loop"] = lambda s: on_stream(lambda nb: pieces_loop.copy(sections, s, nb))
    else:
        print("memkv_vllm._copy_pieces is not built: PieceCopier is not timed")
    for n in args.scratch_chunks:
        copier = copies.SectionCopier(tensors, staging, section, n, pages=[page])
        impls[f"scratch{n}"] = lambda s, copier=copier: on_stream(lambda nb: copier.copy(sections, s, nb))
    conds = [f"{d}/{c}" for d in ("load", "store") for c in ("alone", "busy")]
    results: dict[str, list[float]] = {f"{i}/{c}": [] for c in conds for i in impls}
    for rep in range(args.reps):
        order = list(impls) if rep % 2 == 0 else list(reversed(impls))  # alternate: drift cancels
        for cond in conds:
            to_staging = cond.startswith("store")
            for name in order:
                if to_staging:  # the KV tensors hold the bytes (the loads before were checked)
                    staging.zero_()
                else:
                    for t in tensors:
                        t.zero_()
                    if cuda:  # the zeroing runs on the default stream, the copies on the side stream
                        torch.cuda.synchronize()
                stop = threading.Event()
                spin = threading.Thread(target=spinner, args=(stop,), daemon=True) if cond == "busy" else None
                if spin:
                    spin.start()
                    time.sleep(0.01)
                t0 = time.perf_counter()
                impls[name](to_staging)()
                took = time.perf_counter() - t0
                stop.set()
                if spin:
                    spin.join()
                check(to_staging)
                results[f"{name}/{cond}"].append(took)
    mib = args.chunks * section / 2**20
    print(
        f"{args.device}: {args.chunks} chunks x {n_tensors} tensors x {ppc} pages of {args.page_kib} KiB ({mib:.0f} MiB, "
        f"{len(runs)} runs{', shuffled blocks' if args.shuffle else ''}, {args.staging} staging), {args.reps} reps, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    names = list(impls)
    print("| condition | " + " | ".join(names) + " | " + " | ".join(f"loop / {n}" for n in names[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(names) - 1))
    summary = {}
    for cond in conds:
        base = results[f"loop/{cond}"]
        row = {n: statistics.median(results[f"{n}/{cond}"]) for n in names}
        ratios = {n: statistics.median(a / b for a, b in zip(base, results[f"{n}/{cond}"])) for n in names[1:]}
        summary[cond] = {"median_s": row, "loop_over": ratios}  # ratio: median of per-rep ratios
        print(
            f"| {cond} | "
            + " | ".join(f"{row[n] * 1e3:.1f} ms" for n in names)
            + " | "
            + " | ".join(f"{ratios[n]:.2f}x" for n in names[1:])
            + " |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                "load_avg": os.getloadavg(),
                "times_s": results,
                "summary": summary,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
