"""The node store's pauses while it holds many small values: the garbage collector's full passes.

    python bench/store_pauses.py [--values 1000000] [--value-size 512] [--reps 2] --baseline-src DIR

CPython's full collection walks every object it tracks with the GIL held, so while it runs the
node answers no lookup, GET or PUT. It happens each time the long-lived objects grew by a
quarter, so a node filling with small values, or replacing them, meets it again and again, and
each time it walks every value the node holds.

For this checkout's src/ and for DIR (another revision's src/, e.g. a `git worktree` of the
baseline), each in a fresh interpreter, in turns: a `Store` filled with `--values` values of
`--value-size` bytes, one PUT (begin_put + commit) at a time; reported per run: the longest
PUT, the 99.99th percentile, the full collections that ran, and the objects the collector
tracks per stored value. The ratio is this checkout's longest PUT against the baseline's, in
the same run. Results: bench/out/store_pauses.json.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
OUT = HERE / "out"

# One run, in a fresh interpreter whose sys.path starts with the src/ under test.
FILL = r"""
import gc, json, sys, time
sys.path.insert(0, sys.argv[1])
from memkv.server.store import Store
n, size = int(sys.argv[2]), int(sys.argv[3])
store = Store(max(1 << 30, 2 * n * size))
checksum = bytes(16)
gc.collect()
tracked0, full0 = len(gc.get_objects()), gc.get_stats()[2]["collections"]
lat = []
clock = time.perf_counter
for i in range(n):
    t = clock()
    ticket = store.begin_put(b"key/%d" % i, size, 1, checksum)
    store.commit(ticket)
    lat.append(clock() - t)
full = gc.get_stats()[2]["collections"] - full0
gc.collect()
per_value = (len(gc.get_objects()) - tracked0) / n
lat.sort()
print(json.dumps({"max_s": lat[-1], "p9999_s": lat[int(n * 0.9999)], "p50_s": lat[n // 2],
                  "full_collections": full, "tracked_per_value": per_value}))
"""


def run_fill(src: Path, values: int, size: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", FILL, str(src), str(values), str(size)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", type=int, default=1_000_000)
    ap.add_argument("--value-size", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--baseline-src", type=Path, required=True, help="another revision's src/ (the baseline)")
    args = ap.parse_args()
    if not (args.baseline_src / "memkv" / "server" / "store.py").is_file():
        sys.exit(f"--baseline-src {args.baseline_src}: no memkv/server/store.py there")
    systems = {"this": SRC, "baseline": args.baseline_src.resolve()}
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for rep in range(args.reps):
        order = list(systems) if rep % 2 == 0 else list(reversed(systems))
        for name in order:
            r = run_fill(systems[name], args.values, args.value_size)
            runs[name].append(r)
            print(
                f"rep {rep + 1} {name:<8} longest PUT {r['max_s'] * 1e3:7.1f} ms  p99.99 {r['p9999_s'] * 1e3:5.2f} ms  "
                f"p50 {r['p50_s'] * 1e6:5.1f} us  full collections {r['full_collections']:>2}  "
                f"tracked objects per value {r['tracked_per_value']:.2f}",
                flush=True,
            )
    ratios = [t["max_s"] / b["max_s"] for t, b in zip(runs["this"], runs["baseline"])]
    print(
        f"\n{args.values} values of {args.value_size} B -- {platform.machine()} {os.cpu_count()} cpus, "
        f"Python {platform.python_version()}\nlongest PUT, this / baseline: median {statistics.median(ratios):.2f} "
        f"(per rep {min(ratios):.2f}-{max(ratios):.2f})"
    )
    OUT.mkdir(exist_ok=True)
    result = {"started": started, "cpus": os.cpu_count(), "python": platform.python_version(),
              "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "ratios": ratios}  # fmt: skip
    (OUT / "store_pauses.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
