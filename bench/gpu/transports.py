#!/usr/bin/env python3
"""TCP and RDMA (NIXL over UCX cma) side by side on the GPU host, in one call (issue 16 item 2).

1. Outside vLLM (xfer.py): 8 GiB (512 x 16 MiB) from 4 nodes into pinned memory, the tier's
   access pattern, over TCP and over RDMA with NIXL's thread-sync mode and UCX worker count
   varied (MEMKV_NIXL_SYNC strict|rw, MEMKV_NIXL_WORKERS): where the RDMA path lost to TCP.
2. Inside vLLM (ttft.py --phases main, engine core in its own process, README's tier config):
   the same prompts promoted over TCP, then over RDMA with MemKV's defaults, each with its
   stage breakdown.
Prints one table per part; the JSON files of each run land in --out-dir.

    python3 bench/gpu/transports.py --out-dir $OUT [--tokens 32768,65536] [--skip-engines]
Needs NIXL on PYTHONPATH (stage.sh nixl / install-nixl) and, on an NVIDIA host, cuda_copy in
UCX_TLS (NIXL refuses UCX_TLS without it there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))
from memkv.nixl_adapter import ucx_tls_for_host  # noqa: E402  (adds cuda_copy on an NVIDIA host)

RDMA_ENV = {"MEMKV_TRANSPORT": "rdma", "UCX_TLS": ucx_tls_for_host("cma,tcp,self"), "UCX_NET_DEVICES": "lo"}
XFER = [  # (tag, transport, extra env)
    ("tcp", "tcp", {}),
    ("rdma-strict-w1", "rdma", {"MEMKV_NIXL_SYNC": "strict", "MEMKV_NIXL_WORKERS": "1"}),  # before issue 16
    ("rdma-rw-w1", "rdma", {"MEMKV_NIXL_SYNC": "rw", "MEMKV_NIXL_WORKERS": "1"}),
    ("rdma-strict-w4", "rdma", {"MEMKV_NIXL_SYNC": "strict", "MEMKV_NIXL_WORKERS": "4"}),
    ("rdma-rw-w4", "rdma", {"MEMKV_NIXL_SYNC": "rw", "MEMKV_NIXL_WORKERS": "4"}),
    ("rdma-rw-w8", "rdma", {}),  # MemKV's defaults (rw, 8 workers: the best of run 18)
]


def run(cmd: list[str], env: dict, log_path: str, timeout_s: float) -> int:
    with open(log_path, "w") as log:
        try:
            return subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return 124


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--variants", default="8x8,16x8", help="xfer.py threads x blocks_per_op")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--values", type=int, default=512, help="xfer.py: 16 MiB values per run (512 = 8 GiB, a 32k prompt)"
    )
    ap.add_argument("--tokens", default="32768,65536")
    ap.add_argument("--engine-reps", type=int, default=2)
    ap.add_argument("--skip-engines", action="store_true")
    ap.add_argument("--budget-s", type=float, default=540.0)
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    deadline = time.time() + args.budget_s
    base = {k: v for k, v in os.environ.items() if k not in ("MEMKV_NIXL_SYNC", "MEMKV_NIXL_WORKERS")}
    xfer_rows = []
    for tag, transport, extra in XFER:
        env = {**base, **(RDMA_ENV if transport == "rdma" else {"MEMKV_TRANSPORT": "tcp"}), **extra}
        rc = run(
            [
                sys.executable,
                os.path.join(HERE, "xfer.py"),
                "--transport",
                transport,
                "--tag",
                tag,
                "--variants",
                args.variants,
                "--reps",
                str(args.reps),
                "--values",
                str(args.values),
                "--out-dir",
                args.out_dir,
                "--state-dir",
                f"/tmp/xfer-{tag}",
            ],
            env,
            os.path.join(args.out_dir, f"xfer-{tag}.log"),
            min(120.0, deadline - time.time()),
        )
        try:
            with open(os.path.join(args.out_dir, f"xfer-{transport}-{tag}.json")) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = {"variants": []}
        for v in res["variants"]:
            xfer_rows.append((tag, v["variant"], v["gbps_median"], v["seconds"]))
        if not res["variants"]:
            xfer_rows.append((tag, f"FAILED rc={rc} (see xfer-{tag}.log)", None, []))
        print(f"xfer {tag}: rc={rc}", flush=True)
    tcp_rate = {v: g for t, v, g, _ in xfer_rows if t == "tcp"}
    print(
        f"\n| {args.values} x 16 MiB MemKV -> pinned memory, outside vLLM | variant | GB/s (median) | x TCP | seconds |"
    )
    print("|---|---|---:|---:|---|")
    for tag, var, g, secs in xfer_rows:
        ratio = f"{g / tcp_rate[var]:.2f}x" if g and tcp_rate.get(var) else "-"
        print(
            f"| {tag} | {var} | {'-' if g is None else f'{g:.1f}'} | {ratio} | {' / '.join(f'{x:.3f}' for x in secs)} |"
        )

    if args.skip_engines:
        return 0
    engines = {}
    for label, env_extra in (("tcp", {"MEMKV_TRANSPORT": "tcp"}), ("rdma", RDMA_ENV)):
        left = deadline - time.time()
        if left < 100:
            print(f"engine {label}: skipped, {left:.0f} s left")
            continue
        out = os.path.join(args.out_dir, f"engine-{label}")
        rc = run(
            [
                sys.executable,
                os.path.join(HERE, "ttft.py"),
                "--phases",
                "main",
                "--tokens",
                args.tokens,
                "--reps",
                str(args.engine_reps),
                "--budget-s",
                str(int(left - 10)),
                "--out-dir",
                out,
                "--state-dir",
                f"/tmp/ttft-{label}",
            ],
            {**base, **env_extra},
            out + ".log",
            left,
        )
        try:
            with open(os.path.join(out, "ttft-main.json")) as f:
                engines[label] = json.load(f)
        except (OSError, ValueError):
            engines[label] = None
        print(f"engine {label}: rc={rc}", flush=True)
    print(
        "\n| transport | tokens | recompute s | CPU-pool hit s | MemKV promotion s | MemKV -> pool s | x CPU-pool hit | served whole | node requests GET / RDMA_GET |"
    )
    print("|---|---:|---|---|---|---|---:|---|---|")
    for label, doc in engines.items():
        if not doc:
            print(f"| {label} | FAILED (engine-{label}.log) |")
            continue
        bd = doc.get("breakdown", [])
        for row in doc["rows"]:
            L = row["tokens"]
            mine = [b for b in bd if b["tokens"] == L and b["phase"] == "memkv"]
            pool = (
                " / ".join(f"{b['memkv_to_pool_s']:.3f}" for b in mine if b.get("memkv_to_pool_s") is not None) or "-"
            )
            ratio = (
                f"{statistics.median(row['memkv']) / statistics.median(row['cpu_hit']):.2f}x"
                if row.get("memkv") and row.get("cpu_hit")
                else "-"
            )
            fmt = lambda v: " / ".join(f"{x:.3f}" for x in v) if v else "-"  # noqa: E731
            whole = "yes" if not doc.get("origin_errors") else "NO"
            runs = [
                r
                for e in doc["engines"].values()
                for r in e.get("runs", [])
                if r["phase"] == "memkv" and r["tokens"] == L
            ]
            reqs = (
                f"{sum(r.get('nodes', {}).get('get_requests', 0) for r in runs):.0f} / "
                f"{sum(r.get('nodes', {}).get('rdma_get_requests', 0) for r in runs):.0f}"
            )
            print(
                f"| {label} | {L:,} | {fmt(row.get('recompute'))} | {fmt(row.get('cpu_hit'))} | {fmt(row.get('memkv'))} | "
                f"{pool} | {ratio} | {whole} | {reqs} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
