"""A promotion under a scheduler that never lets go of the GIL: `step_yield_ms` on/off, or TCP vs RDMA.

    .nox/conformance-0-33-0/bin/python bench/busy_scheduler.py [--rows 256] [--row-size 1MiB] [--reps 3]
    .nox/conformance-rdma/bin/python bench/busy_scheduler.py --compare transport [--rows 64 --row-size 16MiB]

Why: vLLM's scheduler steps back to back while requests wait on a tier. When the step has no
GPU work in this process (tensor parallel: the model runs in worker processes), each step is
pure Python, and the tier's lookup and load threads get the GIL only at forced switches (every
5 ms). On an H200 TP=2 engine a 512-key lookup took 1.4-5 s instead of 6 ms
(docs/archive/performance-log.md). While a lookup or load of its own is in flight, the tier now
lowers CPython's switch interval to `step_yield_ms` (memkv_vllm/gil.py); it used to sleep that
long at the end of each step instead, in a hook vLLM expects not to block.

What runs: two real `memkv serve` nodes; an engine (vLLM's real TieringOffloadingManager,
headless harness) stores one prompt of `--rows` chunks; then, per repetition and per setting, a
restarted engine (empty CPU pool) looks the prompt up in a loop with no pause between steps,
like the busy scheduler, until every chunk is HIT, i.e. promoted into its CPU pool. Rows are
compared byte for byte after each promotion. Settings:

* `--compare yield` (default): `step_yield_ms` 0 (no hand-off at all), 1 (the switch interval),
  and 0 with the loop sleeping 1 ms after each step end while the tier has a lookup or load in
  flight (what the tier did before, emulated in this loop); ratios against 0.
  Writes bench/out/busy_scheduler.json.
* `--compare transport`: MEMKV_TRANSPORT=tcp and MEMKV_TRANSPORT=rdma (NIXL over UCX on
  loopback, `--ucx-tls`, default cma,tcp,self: the node copies into the engine's registered pool
  with process_vm_writev), both at `--step-yield-ms` (default 1, the tier's default),
  interleaved; ratio RDMA / TCP per repetition and the median. Each promotion's node counters
  show which path served it (RDMA_GET vs GET requests); a run in which an RDMA promotion used
  GET is refused. `--breakdown` adds where the loaders' time went (seconds summed over loader
  threads, by wrapping the transport's methods in this process). Needs NIXL (the
  conformance-rdma venv). Writes bench/out/busy_scheduler_rdma.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from bench.gpu.tier_probe import LoaderPhases  # noqa: E402
from bench.tier import start_tier_cluster  # noqa: E402
from tests.conformance import vllm_harness as h  # noqa: E402

from memkv.config import parse_size  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def node_requests(node, op: str) -> float:
    """memkv_node_requests_total{op=...} from a node's admin metrics."""
    with urllib.request.urlopen(f"{node.admin_url}/v1/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(rf'^memkv_node_requests_total{{op="{op}"}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


class Breakdown:
    """Seconds the loader threads spent in the transports' phases (summed over threads): the
    calls `LoaderPhases` (bench/gpu/tier_probe.py, shared with the engine-core probe) times."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._phases = LoaderPhases(self._add)

    def _add(self, rec: tuple) -> None:
        _, _, phase, seconds = rec
        with self._lock:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
            self.calls[phase] = self.calls.get(phase, 0) + 1

    def install(self) -> None:
        self._phases.install()

    def take(self) -> dict[str, dict[str, float]]:
        with self._lock:
            out = {k: {"seconds": round(v, 4), "calls": self.calls[k]} for k, v in sorted(self.seconds.items())}
            self.seconds, self.calls = {}, {}
        return out


def promote_busy(
    tier: dict, geometry: h.Geometry, keys, payloads: dict, timeout_s: float, step_sleep_s: float = 0.0
) -> dict:
    """Lookups of every key each step, steps back to back (no model-execution pause); with
    `step_sleep_s`, a sleep after each step end while the tier waits for a lookup or load."""
    with h.HeadlessEngine([tier], geometry) as engine:
        (memkv_tier,) = engine.manager.secondary_tiers
        req = engine.new_request()
        start = time.perf_counter()
        steps = 0
        while True:
            with engine.lock:
                results = [engine.manager.lookup(k, req) for k in keys]
                if all(r is h.LookupResult.HIT for r in results):
                    break
                engine.end_step_locked()
                if step_sleep_s and (memkv_tier._lookup.probing() or memkv_tier._pool.loading()):
                    time.sleep(step_sleep_s)  # inside the step's lock region, as the tier's hook slept
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


@contextlib.contextmanager
def env(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "src"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() + ("+dirty(src)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--row-size", default="1MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4, help="the tier's n_read_threads = n_write_threads")
    ap.add_argument("--blocks-per-op", type=int, default=None, help="the tier's blocks_per_op (default: the tier's)")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--compare", choices=("yield", "transport"), default="yield")
    ap.add_argument("--step-yield-ms", type=float, default=1.0, help="--compare transport: the tier's step_yield_ms")
    ap.add_argument(
        "--ucx-tls", default="cma,tcp,self", help="--compare transport: UCX_TLS for RDMA (nodes and client)"
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="unrecorded rounds of every setting first (default: 1 with --compare transport, else 0): "
        "the nodes register their buffers with NIXL the first time each is a write source",
    )
    ap.add_argument("--breakdown", action="store_true", help="--compare transport: time the loaders' phases")
    ap.add_argument("--label", default="", help="free text stored in the JSON (e.g. which code ran)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/out/busy_scheduler[_rdma].json)")
    args = ap.parse_args()
    if args.rows <= 0 or args.reps <= 0 or args.threads <= 0:
        ap.error("--rows, --reps and --threads must be positive")
    transport = args.compare == "transport"
    if transport:
        from memkv.nixl_adapter import INSTALL_HINT, nixl_available, ucx_tls_for_host

        ok, why = nixl_available()
        if not ok:
            sys.exit(f"--compare transport needs NIXL ({INSTALL_HINT}): {why}")
        # Before the nodes start: they inherit UCX's settings (the RDMA engine's client reads them too).
        os.environ.update(
            {
                "UCX_TLS": ucx_tls_for_host(args.ucx_tls),
                "UCX_NET_DEVICES": "lo",
                "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
            }
        )
        os.environ.setdefault("MEMKV_NIXL_PROGRESS_DELAY_US", "100")
    # The nodes (`python -m memkv serve`) run this tree's code too, not whatever the venv installed.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    geometry, nodes = start_tier_cluster(args.rows, parse_size(args.row_size, "--row-size"), 1.5, 64 << 20)
    base = {
        "type": "memkv",
        "n_read_threads": args.threads,
        "n_write_threads": args.threads,
        "lookup_timeout_s": args.timeout_s,
    }
    if args.blocks_per_op:
        base["blocks_per_op"] = args.blocks_per_op
    if transport:
        settings = {
            "tcp": ({"step_yield_ms": args.step_yield_ms}, {"MEMKV_TRANSPORT": "tcp"}, 0.0),
            "rdma": ({"step_yield_ms": args.step_yield_ms}, {"MEMKV_TRANSPORT": "rdma"}, 0.0),
        }
    else:
        settings = {
            "step_yield_ms=0": ({"step_yield_ms": 0.0}, {}, 0.0),
            "step_yield_ms=1": ({"step_yield_ms": 1.0}, {}, 0.0),
            "sleep_1ms_at_step_end": ({"step_yield_ms": 0.0}, {}, 0.001),
        }
    results: dict[str, list[dict]] = {name: [] for name in settings}
    keys = h.make_keys(args.rows)
    payloads = {k: h.payload_for(k, geometry.row_bytes) for k in keys}
    breakdown = Breakdown() if transport and args.breakdown else None
    load_start = os.getloadavg()
    try:
        with env({"MEMKV_TRANSPORT": "tcp"}), h.HeadlessEngine([dict(base)], geometry) as first:
            req = first.new_request()
            first.store_chunks(req, keys, payloads)
            first.finish_request(req)
            first.step()
            first.run_until_idle(timeout_s=300, max_steps=10**7, poll_s=0.001)
        warmup = args.warmup if args.warmup is not None else (1 if transport else 0)
        for _ in range(warmup):
            for name, (tier_keys, tier_env, sleep_s) in settings.items():
                with env(tier_env):
                    r = promote_busy({**base, **tier_keys}, geometry, keys, payloads, args.timeout_s, sleep_s)
                print(f"warm-up {name}: {r['seconds'] * 1000:8.1f} ms (not recorded)", flush=True)
        if breakdown is not None:
            breakdown.install()
        for rep in range(args.reps):
            order = list(settings.items())
            if transport and rep % 2:
                order.reverse()  # neither transport always runs first
            for name, (tier_keys, tier_env, sleep_s) in order:
                before = {op: sum(node_requests(n, op) for n in nodes) for op in ("get", "rdma_get")}
                with env(tier_env):
                    r = promote_busy({**base, **tier_keys}, geometry, keys, payloads, args.timeout_s, sleep_s)
                r["node_requests"] = {op: sum(node_requests(n, op) for n in nodes) - v for op, v in before.items()}
                if breakdown is not None:
                    r["breakdown"] = breakdown.take()
                results[name].append(r)
                print(
                    f"rep {rep} {name}: promoted {args.rows} x {args.row_size} in {r['seconds'] * 1000:8.1f} ms "
                    f"({r['steps']} steps)  exact={r['byte_exact']}  node requests {r['node_requests']}"
                    + (f"  {r['breakdown']}" if breakdown is not None else ""),
                    flush=True,
                )
                if transport and name == "rdma" and (r["node_requests"]["get"] or not r["node_requests"]["rdma_get"]):
                    raise SystemExit(f"the RDMA promotion did not go over RDMA_GET alone: {r['node_requests']}")
    finally:
        for n in nodes:
            n.stop()
    import vllm

    doc = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "commit": git_commit(),
        "vllm": vllm.__version__,
        "python": sys.version.split()[0],
        "args": vars(args),
        "results": results,
    }
    if transport:
        ratios = [a["seconds"] / b["seconds"] for a, b in zip(results["rdma"], results["tcp"])]
        med = {name: statistics.median(r["seconds"] for r in rs) for name, rs in results.items()}
        print(
            f"promotion time, median: tcp {med['tcp'] * 1000:.1f} ms, rdma {med['rdma'] * 1000:.1f} ms; "
            f"RDMA / TCP per repetition: {', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f})"
        )
        doc.update(
            {
                "env": {
                    k: os.environ.get(k)
                    for k in (
                        "UCX_TLS",
                        "UCX_NET_DEVICES",
                        "MEMKV_NIXL_PROGRESS_DELAY_US",
                        "MEMKV_NIXL_SYNC",
                        "MEMKV_NIXL_WORKERS",
                    )
                },
                "median_seconds": med,
                "ratio_rdma_over_tcp": ratios,
                "ratio_rdma_over_tcp_median": statistics.median(ratios),
            }
        )
        default_out = OUT / "busy_scheduler_rdma.json"
    else:
        ratios = [a["seconds"] / b["seconds"] for a, b in zip(results["step_yield_ms=0"], results["step_yield_ms=1"])]
        slept = [
            a["seconds"] / b["seconds"] for a, b in zip(results["step_yield_ms=0"], results["sleep_1ms_at_step_end"])
        ]
        print(
            f"promotion time, step_yield_ms 0 / 1, per repetition: {', '.join(f'{x:.1f}x' for x in ratios)} "
            f"(median {statistics.median(ratios):.1f}x); 0 / a 1 ms sleep at each step end: "
            f"{', '.join(f'{x:.1f}x' for x in slept)} (median {statistics.median(slept):.1f}x)"
        )
        doc["ratio_no_yield_over_yield"] = ratios
        doc["ratio_no_yield_over_step_end_sleep"] = slept
        default_out = OUT / "busy_scheduler.json"
    out = Path(args.out) if args.out else default_out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
