"""A promotion under a scheduler that never lets go of the GIL: tier key `step_yield_ms` on/off.

    .nox/conformance-0-33-0/bin/python bench/busy_scheduler.py [--rows 256] [--row-size 1MiB] [--reps 3]

Why: vLLM's scheduler steps back to back while requests wait on a tier. When the step has no
GPU work in this process (tensor parallel: the model runs in worker processes), each step is
pure Python, and the tier's lookup and load threads get the GIL only at forced switches (every
5 ms). On an H200 TP=2 engine a 512-key lookup took 1.4-5 s instead of 6 ms
(docs/performance.md). The tier now sleeps `step_yield_ms` at the end of a step while a lookup
or load of its own is in flight.

What runs: two real `memkv serve` nodes; an engine (vLLM's real TieringOffloadingManager,
headless harness) stores one prompt of `--rows` chunks; then, per repetition and per setting
(`step_yield_ms` 0 = the old behaviour, and 1), a restarted engine (empty CPU pool) looks the
prompt up in a loop with no pause between steps, like the busy scheduler, until every chunk is
HIT, i.e. promoted into its CPU pool. Prints promotion time, steps, and the ratio 0 / 1 per
repetition. Rows are compared byte for byte after each promotion. bench/out/busy_scheduler.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from memkv.config import parse_size  # noqa: E402
from bench.tier import start_tier_cluster  # noqa: E402
from tests.conformance import vllm_harness as h  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def promote_busy(tier: dict, geometry: h.Geometry, keys, payloads: dict, timeout_s: float) -> dict:
    """Lookups of every key each step, steps back to back (no model-execution pause)."""
    with h.HeadlessEngine([tier], geometry) as engine:
        req = engine.new_request()
        start = time.perf_counter()
        steps = 0
        while True:
            with engine.lock:
                results = [engine.manager.lookup(k, req) for k in keys]
                if all(r is h.LookupResult.HIT for r in results):
                    break
                engine.end_step_locked()
            steps += 1
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"not promoted after {timeout_s} s ({steps} steps): {results[:4]}")
        seconds = time.perf_counter() - start
        with engine.lock:
            rows = h._row_ids(engine.manager.prepare_load(list(keys), req))
        exact = all(engine.read_row(r) == payloads[k] for k, r in zip(keys, rows))
        with engine.lock:
            engine.manager.complete_load(list(keys), req)
    return {"seconds": seconds, "steps": steps, "byte_exact": exact}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--row-size", default="1MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    args = ap.parse_args()
    geometry, nodes = start_tier_cluster(args.rows, parse_size(args.row_size, "--row-size"), 1.5, 64 << 20)
    base = {"type": "memkv", "n_read_threads": args.threads, "n_write_threads": args.threads,
            "lookup_timeout_s": args.timeout_s}
    settings = {"step_yield_ms=0": 0.0, "step_yield_ms=1": 1.0}
    results: dict[str, list[dict]] = {name: [] for name in settings}
    keys = h.make_keys(args.rows)
    payloads = {k: h.payload_for(k, geometry.row_bytes) for k in keys}
    try:
        with h.HeadlessEngine([dict(base)], geometry) as first:
            req = first.new_request()
            first.store_chunks(req, keys, payloads)
            first.finish_request(req)
            first.step()
            first.run_until_idle(timeout_s=300, max_steps=10**7, poll_s=0.001)
        for rep in range(args.reps):
            for name, ms in settings.items():
                r = promote_busy({**base, "step_yield_ms": ms}, geometry, keys, payloads, args.timeout_s)
                results[name].append(r)
                print(f"rep {rep} {name}: promoted {args.rows} x {args.row_size} in {r['seconds'] * 1000:8.1f} ms "
                      f"({r['steps']} steps)  exact={r['byte_exact']}", flush=True)
    finally:
        for n in nodes:
            n.stop()
    ratios = [a["seconds"] / b["seconds"] for a, b in zip(results["step_yield_ms=0"], results["step_yield_ms=1"])]
    print(f"promotion time, step_yield_ms 0 / 1, per repetition: {', '.join(f'{x:.1f}x' for x in ratios)} "
          f"(median {statistics.median(ratios):.1f}x)")
    import vllm

    OUT.mkdir(exist_ok=True)
    doc = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
           "vllm": vllm.__version__, "python": sys.version.split()[0], "args": vars(args), "results": results,
           "ratio_no_yield_over_yield": ratios}
    (OUT / "busy_scheduler.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
