"""Direct mode on CPU through vLLM's real OffloadingConnector (both sides), 2 local nodes:
load_guarantee "staged" against "leased", interleaved, in one run.

    .nox/conformance-0-33-0/bin/python bench/direct_cpu.py [--chunks 64] [--chunk-tokens 2048] [--tp 1]
        [--reps 5] [--ring-div 8] [--modes staged,leased]

Run with a Python that has vLLM (any nox conformance venv). Per TP size and repetition, each
mode in turn (the order alternates between repetitions, so drift of this noisy box spreads over
both): an engine (tests/conformance/direct_harness.py: scheduler connector + one worker
connector per rank, CPU tensors for the GPU) prefills one prompt of `--chunks` chunks and waits
until every put is done (store: request arrival -> idle); it is shut down; a restarted engine
of the same mode asks for the same prompt (load: request arrival -> every rank's blocks loaded;
every loaded byte is then checked, outside the timing), split at the step where every lookup
has answered (the load job is issued then): "lookups" before, "then" after. "staged" gets a staging region sized
for the whole prompt (so every chunk is reusable: its load is the exists probe, the prefetch
into staging by the engine core's threads and the workers' copies); "leased" a ring of
1/`--ring-div` of the prompt (its load: the leasing lookup, then each worker streaming its
rank's values through the ring with its fetch threads and copies: the "then" part is the
stream). Thread counts are the keys'
defaults (`n_read_threads`/`n_write_threads` = 8) unless `--threads` is given. Printed and in
bench/out/direct_cpu.json: per mode the median (min-max) load and store time, the load's GB/s,
and the ratio of the medians leased/staged (plus the median of the per-repetition ratios).
The simulated model (hashing each block's bytes) is part of the store figure; compare store
figures between configurations, not with a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from tests.conformance import direct_harness as dh  # noqa: E402

from memkv.local import LocalNode, new_key_hex  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
MIB = 1 << 20


def staging_mb_for(mode: str, tp: int, chunks: int, g: dh.Geometry, ring_div: int) -> int:
    section = -(-g.value_bytes // 4096) * 4096
    prompt = chunks * tp * section
    if mode == "staged":  # the whole prompt, plus one store job's worth of slack
        return -(-(prompt + 8 * tp * section) // MIB)
    return max(-(-(prompt // ring_div) // MIB), -(-(2 * tp * section) // MIB))  # >= 2 slots


def one(mode: str, tp: int, chunks: int, chunk_tokens: int, ring_div: int, threads: int | None) -> dict:
    g = dh.Geometry(world_size=tp, block_size=chunk_tokens, num_gpu_blocks=2 * (chunks * chunk_tokens // 16) + 64)
    staging_mb = staging_mb_for(mode, tp, chunks, g, ring_div)
    extra = {} if threads is None else {"n_read_threads": threads, "n_write_threads": threads}
    config = dh.direct_config(staging_mb=staging_mb, block_size=chunk_tokens, load_guarantee=mode, **extra)
    tag = uuid.uuid4().hex
    tokens = chunks * chunk_tokens + 1
    with dh.DirectEngine(g, config, token_budget=8192, step_sleep_s=0.0005) as engine:
        t = time.perf_counter()
        engine.run(tag, tokens, timeout_s=600)
        store_s = time.perf_counter() - t
        region = engine.manager.layout.region_bytes
    with dh.DirectEngine(g, config, token_budget=8192, step_sleep_s=0.0005, check_loads=False) as restarted:
        req = restarted.add_request(tag, tokens)
        t = time.perf_counter()
        restarted.run_until(lambda: req.matched_tokens is not None, timeout_s=600)
        lookup_s = time.perf_counter() - t  # every lookup answered: the load job is issued in this step
        restarted.run_until(lambda: req.status.name != "WAITING_FOR_REMOTE_KVS", timeout_s=600)
        load_s = time.perf_counter() - t
        steps = restarted.step_count
        restarted.check_loaded(req)  # byte for byte, outside the timing
        restarted.run_until(lambda: req.is_finished(), timeout_s=600)
        matched = req.matched_tokens
        streams = getattr(restarted.workers[0].connector_worker.worker, "_streams", None)
        ring = (
            None
            if streams is None
            else {k: getattr(streams, k, None) for k in ("n_fetch", "n_put", "load_batch", "store_batch", "copy_waits")}
        )
    nbytes = chunks * tp * g.value_bytes
    return {
        "mode": mode,
        "tp": tp,
        "chunks": chunks,
        "value_bytes": g.value_bytes,
        "prompt_bytes": nbytes,
        "staging_bytes": region,
        "store_s": store_s,
        "load_s": load_s,
        "lookup_s": lookup_s,
        "after_lookup_s": load_s - lookup_s,
        "load_steps": steps,
        "matched_tokens": matched,
        "load_gb_s": nbytes / load_s / 1e9,
        "after_lookup_gb_s": nbytes / (load_s - lookup_s) / 1e9,
        "rank0_streams": ring,
    }


def _median_row(runs: list[dict]) -> dict:
    loads = [r["load_s"] for r in runs]
    stores = [r["store_s"] for r in runs]
    return {
        "staging_mib": runs[0]["staging_bytes"] / MIB,
        "load_s_median": statistics.median(loads),
        "lookup_s_median": statistics.median(r["lookup_s"] for r in runs),
        "after_lookup_s_median": statistics.median(r["after_lookup_s"] for r in runs),
        "after_lookup_gb_s_median": statistics.median(r["after_lookup_gb_s"] for r in runs),
        "load_s_min": min(loads),
        "load_s_max": max(loads),
        "store_s_median": statistics.median(stores),
        "store_s_min": min(stores),
        "store_s_max": max(stores),
        "load_gb_s_median": statistics.median(r["load_gb_s"] for r in runs),
        "load_steps": sorted({r["load_steps"] for r in runs}),
        "rank0_streams": runs[-1]["rank0_streams"],
    }


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-tokens", type=int, default=2048)  # 1 MiB per rank per chunk in the harness shape
    ap.add_argument("--tp", default="1")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ring-div", type=int, default=8, help='"leased" staging = prompt / this')
    ap.add_argument("--modes", default="staged,leased")
    ap.add_argument("--threads", type=int, default=None, help="n_read_threads = n_write_threads (default: the keys')")
    ap.add_argument("--out", default=str(OUT / "direct_cpu.json"))
    args = ap.parse_args()
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in ("staged", "leased"):
            ap.error(f"--modes: unknown mode {mode!r} (staged, leased)")
    key = new_key_hex()
    nodes = [LocalNode(key, capacity="2GiB") for _ in range(2)]
    os.environ.update(
        {
            "MEMKV_SERVERS": ",".join(n.address for n in nodes),
            "MEMKV_AUTH_KEY": key,
            "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0"),
        }
    )
    os.environ.pop("MEMKV_CONFIG", None)
    results = []
    try:
        for tp in [int(x) for x in args.tp.split(",")]:
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for rep in range(args.reps):
                order = modes if rep % 2 == 0 else modes[::-1]
                for mode in order:
                    r = one(mode, tp, args.chunks, args.chunk_tokens, args.ring_div, args.threads)
                    assert r["matched_tokens"] == args.chunks * args.chunk_tokens, r
                    runs[mode].append(r)
                    print(
                        f"  rep {rep} TP={tp} {mode}: load {r['load_s']:.3f} s ({r['load_gb_s']:.2f} GB/s; lookups "
                        f"{r['lookup_s']:.3f} s, then {r['after_lookup_s']:.3f} s), store {r['store_s']:.2f} s",
                        flush=True,
                    )
            row: dict = {
                "tp": tp,
                "prompt_mib": runs[modes[0]][0]["prompt_bytes"] / MIB,
                "modes": {m: _median_row(rs) for m, rs in runs.items()},
                "runs": runs,
            }
            if set(modes) == {"staged", "leased"}:
                row["leased_over_staged_load"] = (
                    row["modes"]["leased"]["load_s_median"] / row["modes"]["staged"]["load_s_median"]
                )
                row["leased_over_staged_load_per_rep_median"] = statistics.median(
                    a["load_s"] / b["load_s"] for a, b in zip(runs["leased"], runs["staged"])
                )
            results.append(row)
            for m, s in row["modes"].items():
                # "staged" copies from staging in the step its lookups HIT: its "then" is ~0
                stream = f" = {s['after_lookup_gb_s_median']:.2f} GB/s" if m == "leased" else ""
                print(
                    f"TP={tp} {m}: prompt {row['prompt_mib']:.0f} MiB, staging {s['staging_mib']:.0f} MiB: load "
                    f"(restarted engine) {s['load_s_median']:.3f} s ({s['load_s_min']:.3f}-{s['load_s_max']:.3f}) "
                    f"= {s['load_gb_s_median']:.2f} GB/s (lookups {s['lookup_s_median']:.3f} s, then "
                    f"{s['after_lookup_s_median']:.3f} s{stream}); store {s['store_s_median']:.2f} s",
                    flush=True,
                )
            if "leased_over_staged_load" in row:
                print(
                    f"TP={tp} leased/staged load: {row['leased_over_staged_load']:.2f} (medians), "
                    f"{row['leased_over_staged_load_per_rep_median']:.2f} (median of per-rep ratios)",
                    flush=True,
                )
    finally:
        for n in nodes:
            n.stop()
    import vllm

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "host": {
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "vllm": vllm.__version__,
                    "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "loadavg": os.getloadavg(),
                },
                "commit": _git("rev-parse", "--short", "HEAD"),
                "dirty": bool(_git("status", "--porcelain", "src")),
                "args": vars(args),
                "results": results,
            },
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
