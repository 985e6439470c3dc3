"""The memkv tier inside vLLM's real TieringOffloadingManager, against vLLM's fs tier.

    .nox/conformance-0-33-0/bin/python bench/tier.py [--rows 128] [--row-size 16MiB] [--reps 3]

Run with a Python that has vLLM (any nox conformance venv). Each repetition, for each tier:
an engine stores one prompt of `--rows` chunks (16 MiB rows, the seed page's sizing) and waits
for the cascade (cascade throughput); the engine is shut down; a second engine (a restart,
empty CPU pool) looks the prompt up and promotes it (promotion time: first lookup until every
chunk is HIT in the pool). Tiers: memkv (2 local nodes), fs on local disk, fs on /dev/shm.
Rows are compared byte for byte after each promotion (outside the timing). Results:
bench/out/tier.json (+ tier.png with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from tests.conformance import vllm_harness as h  # noqa: E402

from memkv.config import format_size, parse_size  # noqa: E402
from memkv.local import LocalNode, new_key_hex  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


class _Payloads(dict):
    """Row bytes of a key (the key stamped on a shared random block), built when asked for."""

    def __init__(self, base: bytes) -> None:
        super().__init__()
        self.base = base

    def __missing__(self, key: bytes) -> bytes:
        return key + self.base[len(key) :]


class _Forgetful(dict):
    def __setitem__(self, key, value) -> None:
        pass


def run_tier(tier: dict, geometry: h.Geometry, rows: int) -> dict:
    keys = h.make_keys(rows)
    base = os.urandom(geometry.row_bytes)
    payloads = _Payloads(base)  # distinct rows, made on demand: 512 rows are 8 GiB
    with h.HeadlessEngine([tier], geometry) as first:
        first.payloads = _Forgetful()  # the harness records every payload; a bench need not
        req = first.new_request()
        # store_chunks ends with complete_store, which hands the cascade to the tier: time from
        # there (writing the rows stands in for vLLM's GPU->CPU copy and is not the tier's).
        first.store_chunks(req, keys, payloads)
        t = time.perf_counter()
        first.finish_request(req)
        first.step()
        first.run_until_idle(timeout_s=600, max_steps=10**7, poll_s=0.001)
        cascade_s = time.perf_counter() - t
    with h.HeadlessEngine([tier], geometry) as second:
        req = second.new_request()
        trace = second.lookup_until_resolved(keys, req, max_steps=100_000, timeout_s=600, poll_s=0.001)
        promote_s = trace.elapsed_s
        assert trace.resolved and all(r is h.LookupResult.HIT for r in trace.final), trace.summary(0)
        with second.lock:
            row_ids = h._row_ids(second.manager.prepare_load(list(keys), req))
        exact = all(second.read_row(r) == payloads[k] for k, r in zip(keys, row_ids))
        with second.lock:
            second.manager.complete_load(list(keys), req)
    nbytes = rows * geometry.row_bytes
    return {
        "cascade_s": cascade_s,
        "promote_s": promote_s,
        "cascade_gbps": nbytes / cascade_s / 1e9,
        "promote_gbps": nbytes / promote_s / 1e9,
        "steps_to_hit": len(trace.steps),
        "byte_exact": exact,
    }


def start_tier_cluster(rows: int, row_bytes: int, fill: float, headroom: int) -> tuple[h.Geometry, list[LocalNode]]:
    """The tier benches' setup: a one-rank geometry of `rows` chunks of `row_bytes`, two local
    nodes holding `fill` x the prompt between them (+ `headroom` each), MEMKV_* pointed at them
    and the memkv tier registered with vLLM."""
    # One rank, 64-token chunks of 4 GPU blocks: worker bytes per GPU block = row / 4.
    geometry = h.Geometry(
        world_size=1, worker_kv_bytes_per_block=row_bytes // 4, gpu_block_size=16, block_size=64, num_rows=rows + 8
    )
    key = new_key_hex()
    capacity = str(int(rows * geometry.row_bytes * fill / 2) + headroom)
    nodes = [LocalNode(key, capacity=capacity) for _ in range(2)]
    os.environ.update({"MEMKV_SERVERS": ",".join(n.address for n in nodes), "MEMKV_AUTH_KEY": key})
    import memkv_vllm

    memkv_vllm.register()
    return geometry, nodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--row-size", default="16MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4, help="n_read_threads = n_write_threads for every tier")
    ap.add_argument(
        "--tiers",
        default="memkv,fs (disk),fs (/dev/shm)",
        help="comma-separated subset (512 rows: the /dev/shm copy does not fit in 24 GiB next to the rest)",
    )
    args = ap.parse_args()
    geometry, nodes = start_tier_cluster(args.rows, parse_size(args.row_size, "--row-size"), 1.2, 256 << 20)
    disk_root = tempfile.mkdtemp(prefix="memkv-bench-fs-", dir=os.environ.get("BENCH_DISK_DIR", "/var/tmp"))
    shm_root = tempfile.mkdtemp(prefix="memkv-bench-fs-", dir="/dev/shm")
    t = args.threads
    tiers = {
        "memkv": {"type": "memkv", "n_read_threads": t, "n_write_threads": t, "max_store_backlog_mb": 1 << 16},
        "fs (disk)": {"type": "fs", "root_dir": disk_root, "n_read_threads": t, "n_write_threads": t},
        "fs (/dev/shm)": {"type": "fs", "root_dir": shm_root, "n_read_threads": t, "n_write_threads": t},
    }
    tiers = {name: tier for name, tier in tiers.items() if name in args.tiers.split(",")}
    results: dict[str, list[dict]] = {name: [] for name in tiers}
    try:
        for rep in range(args.reps):
            for name, tier in tiers.items():
                for root in (disk_root, shm_root):  # each repetition starts from an empty fs tier
                    shutil.rmtree(root, ignore_errors=True)
                    os.makedirs(root, exist_ok=True)
                results[name].append(run_tier(dict(tier), geometry, args.rows))
                r = results[name][-1]
                print(
                    f"rep {rep} {name:<14} cascade {r['cascade_gbps']:6.2f} GB/s  promote {r['promote_s'] * 1000:8.1f} ms "
                    f"({r['promote_gbps']:.2f} GB/s, {r['steps_to_hit']} steps)  exact={r['byte_exact']}",
                    flush=True,
                )
    finally:
        for n in nodes:
            n.stop()
        shutil.rmtree(disk_root, ignore_errors=True)
        shutil.rmtree(shm_root, ignore_errors=True)

    import vllm

    summary = {}
    for name, rs in results.items():
        summary[name] = {k: statistics.median(r[k] for r in rs) for k in ("cascade_gbps", "promote_s", "promote_gbps")}
        summary[name]["byte_exact"] = all(r["byte_exact"] for r in rs)
    ratios = {
        other: {
            "promote_speedup": statistics.median(
                o["promote_s"] / m["promote_s"] for o, m in zip(results[other], results["memkv"])
            ),
            "cascade_ratio": statistics.median(
                m["cascade_gbps"] / o["cascade_gbps"] for o, m in zip(results[other], results["memkv"])
            ),
        }
        for other in tiers
        if other != "memkv"
    }
    result = {
        "benchmark": "tier",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "vllm": vllm.__version__,
        "rows": args.rows,
        "row_bytes": geometry.row_bytes,
        "threads": t,
        "reps": args.reps,
        "runs": results,
        "summary": summary,
        "memkv_vs": ratios,
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "tier.json").write_text(json.dumps(result, indent=2))
    print(
        f"\n{args.rows} rows x {format_size(geometry.row_bytes)}, vLLM {vllm.__version__}, {t} threads -- {result['machine']}"
    )
    print(f"{'tier':<14} {'cascade GB/s':>13} {'promote ms':>11} {'promote GB/s':>13}")
    for name, s in summary.items():
        print(f"{name:<14} {s['cascade_gbps']:>13.2f} {s['promote_s'] * 1000:>11.1f} {s['promote_gbps']:>13.2f}")
    for other, r in ratios.items():
        print(
            f"memkv vs {other}: promotion {r['promote_speedup']:.2f}x faster, cascade {r['cascade_ratio']:.2f}x the throughput"
        )


if __name__ == "__main__":
    main()
