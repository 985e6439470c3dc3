#!/usr/bin/env python3
"""Tables (markdown) and the plots of docs/archive/performance-log.md "GPU end to end", from the JSON files
that bench/gpu/ttft.py, bench/gpu/serve.py and bench/gpu/xfer.py wrote on the GPU host (copied to
bench/gpu/results/). Runs anywhere (matplotlib only).

  python3 bench/gpu/report.py --defaults                                  # 2026-12-01: runs 13-15
  python3 bench/gpu/report.py [--results bench/gpu/results]             # tuned: runs 6-12
  python3 bench/gpu/report.py --history                                   # morning: runs 1-5
  python3 bench/gpu/report.py --breakdown                                 # run 17's stages (TCP)
  python3 bench/gpu/report.py --transports                                # run 34: TCP vs RDMA stages

Which file plays which role is fixed below (DEFAULTS, CURRENT, RUNS); the markdown goes to
stdout, the plots to docs/img/gpu-ttft-defaults.png (--defaults), docs/img/gpu-ttft.png (tuned)
and docs/img/gpu-ttft-history.png (--history).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# file -> what it measured (see bench/gpu/stage.md "What ran")
RUNS = {
    "run1-4nodes-main-restart.json": "4 nodes, client as shipped (1 MiB receive/verify chunks)",
    "run2-fs-restart.json": "fs tier engine + a second restart engine on run 1's nodes",
    "run3-8nodes-main.json": "8 nodes, 32k only (sweep)",
    "run4-chunk-main-restart.json": "4 nodes, EXPERIMENT: client receive/verify chunk patched to 4 MiB",
    "run5-verify16-main-restart.json": "4 nodes, 32k only, client verifying whole values (16 MiB pieces), as shipped",
}


# The afternoon runs (client verifying whole values; tier step_yield_ms from run 9 on).
CURRENT = {
    "run6-main-restart.json": "TP=1, 1x H200 host (16 vCPUs): main (sweep + 8k/32k/64k x 2) + restart",
    "run7-fs-restart.json": "TP=1, same host: fs tier engine + a second restart on run 6's nodes",
    "run8-tp2-noyield-main-restart.json": "TP=2, 2x H200 host (32 vCPUs), BEFORE step_yield_ms (starved lookups)",
    "run9-tp2-main-restart.json": "TP=2, same host, step_yield_ms 1 (default): main + restart",
    "run10-tp2-fs-restart.json": "TP=2, same host: fs tier engine + a second restart on run 9's nodes",
    "run11-x2host-tp1-main.json": "TP=1 on the 2-GPU host (one GPU), step_yield_ms 1, 32k only",
    "run12-x2host-tp1-noyield-main.json": "TP=1 on the 2-GPU host, step_yield_ms 0, 32k only (prompt already in MemKV)",
}


# 2026-12-01: README's tier config, no tuned keys, engine core in its own process (vLLM's default
# layout); commit d2b5392. No tier object in the benchmark's process in that layout, so origin
# comes from the nodes' memkv_node_sent_bytes_total and there is no stage breakdown.
DEFAULTS = {
    "run13-defaults-mp-main-restart.json": "TP=1, 1x H200 (16 vCPUs): README's tier config, main (8k/32k/64k x 2) + restart",
    "run14-serve-readme.json": "same host: `vllm serve` with README's --kv-transfer-config verbatim, restarted on the same nodes",
    "run15-notier.json": "same host: TieringOffloadingSpec without a secondary tier, cold runs only (x 3)",
}


def load(results: str, names=None) -> dict:
    out = {}
    for name in names or RUNS:
        path = os.path.join(results, name)
        if os.path.exists(path):
            with open(path) as f:
                out[name] = json.load(f)
    return out


def runs_of(doc: dict, role: str | None = None, phase: str | None = None, tokens: int | None = None) -> list:
    out = []
    for r_role, eng in doc["engines"].items():
        if role and r_role != role:
            continue
        for r in eng.get("runs", []):
            if phase and r["phase"] != phase:
                continue
            if tokens and r["tokens"] != tokens:
                continue
            out.append(r)
    return out


def med(xs):
    return statistics.median(xs) if xs else None


def fmt(xs) -> str:
    return " / ".join(f"{x:.2f}" for x in xs) if xs else "-"


def breakdown(r: dict) -> dict:
    """Stages of one promotion run (seconds), summing to the run's total."""
    tl = r["timeline"]
    total = r["seconds"]
    sub = tl.get("first_submit_load_s", 0.0)
    taken = tl.get("last_job_taken_s", sub)
    # The tier's own job clock (submit_load -> last task done); the manager takes the result at
    # its next poll (`taken`).
    done = sub + max(tl["load_job_s"]) if tl.get("load_job_s") else taken
    return {
        "lookup": sub,
        "transfer": done - sub,
        "notice": taken - done,
        "to_gpu": total - taken,
        "total": total,
        "exists_rounds": tl.get("exists_rounds"),
        "exists_round_ms": [round(x * 1e3, 1) for x in tl.get("exists_round_s", [])],
        "gbps": (sum(v for k, v in r.get("tier_counters", {}).items() if "load_bytes" in k) / (done - sub) / 1e9)
        if done > sub and tl.get("load_job_s")
        else None,
    }


LENGTHS = [8192, 32768, 65536]
PHASE_BARS = [
    ("recompute", "recompute (cold)", "#b0b0b0"),
    ("fs", "vLLM fs tier", "#e39b52"),
    ("restart", "MemKV after engine restart", "#7aa6d6"),
    ("memkv", "MemKV promotion", "#2a6db5"),
    ("cpu_hit", "CPU-pool hit", "#5aa55a"),
]
STAGES = [
    ("lookup", "lookup", "#999999"),
    ("transfer", "tier -> CPU pool", "#2a6db5"),
    ("notice", "job noticed", "#f0c040"),
    ("to_gpu", "CPU pool -> GPU, last block, token", "#5aa55a"),
]


def plot_phases(
    ax,
    series: dict,
    kvpt: int,
    title: str,
    bars_spec=None,
    lengths=None,
    ranges: bool = False,
    tick_extra=None,
    width: float = 0.16,
) -> None:
    """Grouped bars: median TTFT per phase and prompt length (log scale); `ranges`: min-max
    whiskers over the repetitions, `tick_extra`: a further line under each length's label."""
    bars_spec = bars_spec or PHASE_BARS
    lengths = lengths or LENGTHS
    w = width
    for i, (key, label, color) in enumerate(bars_spec):
        vals = [med(series[L][key]) or 0 for L in lengths]
        xs = [j + (i - (len(bars_spec) - 1) / 2) * w for j in range(len(lengths))]
        bars = ax.bar(xs, vals, w, label=label, color=color)
        tops = vals
        if ranges:
            lo = [v - min(series[L][key]) if series[L][key] else 0 for v, L in zip(vals, lengths)]
            hi = [max(series[L][key]) - v if series[L][key] else 0 for v, L in zip(vals, lengths)]
            ax.errorbar(xs, vals, yerr=[lo, hi], fmt="none", ecolor="#333333", elinewidth=0.8, capsize=2)
            tops = [v + h for v, h in zip(vals, hi)]
        for b, v, t in zip(bars, vals, tops):
            if v:
                ax.text(b.get_x() + b.get_width() / 2, t * 1.04, f"{v:.2f}", ha="center", va="bottom", fontsize=6.5)
    ax.set_xticks(
        range(len(lengths)),
        [
            f"{L // 1024}k tokens\n({L * kvpt / 2**30:g} GiB KV)"
            + (f"\n{tick_extra[L]}" if tick_extra and L in tick_extra else "")
            for L in lengths
        ],
    )
    ax.set_yscale("log")
    ax.set_ylabel("time to first token, s (median, log scale)")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(axis="y", alpha=0.3, which="both")


def plot_stages(bx, rows: dict) -> None:
    """Stacked horizontal bars: where each labelled 32k promotion spent its time."""
    labels = list(rows)
    for yi, lab in enumerate(labels):
        m = rows[lab]
        left = 0.0
        for k, name, color in STAGES:
            if k == "transfer" and lab.startswith("fs"):
                color = "#e39b52"
            bx.barh(yi, m[k], left=left, color=color, label=name if yi == 0 else None)
            left += m[k]
        bx.text(left + 0.03, yi, f"{m['total']:.2f} s", va="center", fontsize=8)
    for x, style in ((1.2, "--"), (0.8, ":")):
        bx.axvline(x, color="red", ls=style, lw=1)
        bx.text(x, -0.6, f" {x} s", color="red", fontsize=8)
    bx.set_yticks(range(len(labels)), [lab.replace(" (", "\n(") for lab in labels], fontsize=7.5)
    bx.invert_yaxis()
    bx.set_xlabel("seconds (median)")
    bx.set_title("Where a 32k-token promotion spends its time")
    bx.legend(fontsize=7, loc="lower right")
    bx.set_xlim(0, max(m["total"] for m in rows.values()) * 1.15)


def save(fig, path: str) -> None:
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


# (label, results file, mode): each bar one engine mode of one bench/gpu/direct.py call
DIRECT_BARS = [
    ("leased, per-run copies\n(run 21, 0.5 GiB)", "run21-leased-direct-tier.json", "direct"),
    ("leased, GPU scratch\n(run 26, 0.5 GiB)", "run26-leased-scratch128-direct.json", "direct"),
    ("staged\n(run 27, 9 GiB)", "run27-staged-direct.json", "direct"),
    ("tier\n(run 26, 24 GiB pool)", "run26-leased-scratch128-direct.json", "tier"),
]


def direct_plot(args) -> int:
    """Revisit TTFT of the main engine (bar) and of the restarted engine (dot) per direct-mode
    setting and the tier, against recompute measured in the same calls (dashed: the median)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = (8192, 32768)
    fig, axes = plt.subplots(1, len(lengths), figsize=(11, 4.2))
    print("| setting | prompt | recompute | revisit | restarted |\n|---|---|---:|---:|---:|")
    for ax, tokens in zip(axes, lengths):
        recompute, xs = [], []
        for i, (label, name, mode) in enumerate(DIRECT_BARS):
            with open(os.path.join(args.results, name)) as f:
                doc = json.load(f)
            times = {}
            for e in doc["engines"]:
                if e["mode"] != mode:
                    continue
                for r in e["runs"]:
                    if r["tokens"] == tokens:
                        times.setdefault(r["phase"], []).append(r["seconds"])
            recompute += times.get("recompute", [])
            revisit, restart = med(times.get("memkv", [])), med(times.get("restart", []))
            ax.bar(i, revisit, color="#4C72B0" if mode == "direct" else "#55A868")
            ax.plot([i], [restart], "o", color="black", ms=5)
            ax.text(i, revisit / 2, f"{revisit:.2f} s", ha="center", va="center", fontsize=8, color="white")
            xs.append(label)
            print(
                f"| {label.replace(chr(10), ' ')} | {tokens} | {med(times.get('recompute', [])):.2f} | "
                f"{revisit:.2f} | {restart:.2f} |"
            )
        ax.axhline(med(recompute), ls="--", color="#C44E52", label=f"recompute (median {med(recompute):.2f} s)")
        ax.set_xticks(range(len(xs)), xs, fontsize=7)
        ax.set_ylabel("TTFT, s")
        ax.set_title(
            f"{tokens // 1024}k-token prompt, 32B shape, H200 (bar: revisit, dot: restarted engine)", fontsize=8
        )
        ax.legend(fontsize=7)
    save(fig, args.img)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    ap.add_argument("--history", action="store_true", help="the morning runs 1-5 (before the client fix)")
    ap.add_argument(
        "--defaults",
        action="store_true",
        help="the runs of 2026-12-01 (13-15): README's tier config, engine core in its own process",
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="run 17: the stages of each promotion with the defaults (engine core in its own process)",
    )
    ap.add_argument(
        "--transports", action="store_true", help="run 34: the stages of TCP and RDMA engines side by side (one call)"
    )
    ap.add_argument(
        "--pipeline",
        action="store_true",
        help="run 39: TCP, RDMA and RDMA with pipelined RDMA_GETs side by side (one call)",
    )
    ap.add_argument(
        "--local", action="store_true", help="runs 43-47: loopback TCP vs the same-host socket, two machines"
    )
    ap.add_argument("--shm", action="store_true", help="runs 54-56: shared memory on by default vs off, one machine")
    ap.add_argument(
        "--direct",
        action="store_true",
        help="direct mode (runs 21, 26, 27): revisit TTFT per mode, pinned host memory, vs recompute",
    )
    ap.add_argument("--img", default=None)
    args = ap.parse_args()
    if args.direct:
        args.img = args.img or os.path.join(REPO, "docs", "img", "gpu-direct.png")
        return direct_plot(args)
    if args.shm:
        args.img = args.img or os.path.join(REPO, "docs", "img", "gpu-breakdown-shm.png")
        return shm_plot(args)
    if args.local:
        args.img = args.img or os.path.join(REPO, "docs", "img", "gpu-breakdown-local.png")
        return local_plot(args)
    if args.pipeline:
        args.img = args.img or os.path.join(REPO, "docs", "img", "gpu-breakdown-pipeline.png")
        return pipeline_plot(args)
    if args.transports:
        args.img = args.img or os.path.join(REPO, "docs", "img", "gpu-breakdown-transports.png")
        return transports_plot(args)
    if args.breakdown:
        args.img = args.img or os.path.join(REPO, "docs", "img", "gpu-breakdown-defaults.png")
        return breakdown_plot(args)
    if args.defaults:
        args.img = args.img or os.path.join(REPO, "docs", "img", "gpu-ttft-defaults.png")
        return defaults(args)
    if args.history:
        args.img = args.img or os.path.join(REPO, "docs", "img", "gpu-ttft-history.png")
        return history(args)
    args.img = args.img or os.path.join(REPO, "docs", "img", "gpu-ttft.png")
    return current(args)


def ttft_table(main_doc: dict, fs_doc: dict | None) -> dict:
    """The TTFT table of one configuration (main+restart engines, fs+restart engines)."""
    kvpt = main_doc["meta"]["kv_bytes_per_token"]
    print(
        "| prompt tokens | KV bytes | recompute | CPU-pool hit | MemKV promotion | MemKV after restart "
        "| fs tier promotion | recompute / MemKV | fs / MemKV |"
    )
    print("|---:|---:|---|---|---|---|---|---:|---:|")
    series = {}
    for L in LENGTHS:
        rec = [r["seconds"] for r in runs_of(main_doc, "main", "recompute", L)]
        rec_fs = [r["seconds"] for r in runs_of(fs_doc, "fs", "recompute", L)] if fs_doc else []
        cpu = [r["seconds"] for r in runs_of(main_doc, "main", "cpu_hit", L)]
        mk = [r["seconds"] for r in runs_of(main_doc, "main", "memkv", L)]
        rs = [r["seconds"] for r in runs_of(main_doc, "restart", "restart_memkv", L)]
        rs2 = [r["seconds"] for r in runs_of(fs_doc, "restart", "restart_memkv", L)] if fs_doc else []
        fs = [r["seconds"] for r in runs_of(fs_doc, "fs", "fs", L)] if fs_doc else []
        mk_all = mk + rs + rs2
        series[L] = {
            "recompute": rec + rec_fs,
            "cpu_hit": cpu,
            "memkv": mk,
            "restart": rs + rs2,
            "fs": fs,
            "memkv_all": mk_all,
        }
        s1 = f"{med(rec + rec_fs) / med(mk_all):.1f}x" if rec and mk_all else "-"
        s2 = f"{med(fs) / med(mk_all):.1f}x" if fs and mk_all else "-"
        rs_txt = fmt(rs) + (f"; {fmt(rs2)}" if rs2 else "")
        print(
            f"| {L:,} | {L * kvpt / 2**30:g} GiB | {fmt(rec + rec_fs)} s | {fmt(cpu)} s | {fmt(mk)} s | {rs_txt} s "
            f"| {fmt(fs)} s | {s1} | {s2} |"
        )
    return series


def breakdown_row(label: str, rr: list) -> dict:
    bds = [breakdown(r) for r in rr]
    m = {k: med([b[k] for b in bds]) for k in ("lookup", "transfer", "notice", "to_gpu", "total")}
    g = med([b["gbps"] for b in bds if b["gbps"]])
    rounds = [ms for b in bds for ms in b["exists_round_ms"]]
    print(
        f"| {label} (n={len(bds)}) | {m['lookup'] * 1e3:.0f} ms | {med(rounds):.0f} ms | {m['transfer'] * 1e3:.0f} ms "
        f"| {m['notice'] * 1e3:.0f} ms | {m['to_gpu'] * 1e3:.0f} ms | {m['total']:.2f} s | {g:.1f} GB/s |"
    )
    return m


def current(args) -> int:
    docs = load(args.results, CURRENT)
    tp1, tp1fs = docs["run6-main-restart.json"], docs.get("run7-fs-restart.json")
    tp2, tp2fs = docs["run9-tp2-main-restart.json"], docs.get("run10-tp2-fs-restart.json")
    before = docs.get("run8-tp2-noyield-main-restart.json")
    print("### TP=1, one H200 (16 vCPUs), runs 6+7\n")
    s1 = ttft_table(tp1, tp1fs)
    print("\n### TP=2, two H200 (32 vCPUs), runs 9+10 (tier step_yield_ms 1, the default)\n")
    s2 = ttft_table(tp2, tp2fs)
    if before:
        print("\n### TP=2 before step_yield_ms (run 8, same host, same prompts)\n")
        ttft_table(before, None)

    print("\n### Breakdown of the 32k-token promotions\n")
    print(
        "| 32,768 tokens | lookup (first lookup -> load submitted) | exists round (median) | MemKV -> CPU pool "
        "| job noticed | CPU pool -> GPU + last block + token | total | MemKV -> pool rate |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    bd = {}

    def memkv_runs(doc, fs_doc):
        return (
            runs_of(doc, "main", "memkv", 32768)
            + runs_of(doc, "restart", "restart_memkv", 32768)
            + (runs_of(fs_doc, "restart", "restart_memkv", 32768) if fs_doc else [])
        )

    bd["TP=1, 16 vCPUs (runs 6+7)"] = breakdown_row(
        "TP=1, 16 vCPUs, main + restarts (runs 6+7)", memkv_runs(tp1, tp1fs)
    )
    if before:
        bd["TP=2 before step_yield_ms (run 8)"] = breakdown_row(
            "TP=2 before step_yield_ms, promotions that hit (run 8)",
            [r for r in memkv_runs(before, None) if r["timeline"].get("load_job_s")],
        )
    bd["TP=2, step_yield_ms 1 (runs 9+10)"] = breakdown_row(
        "TP=2, step_yield_ms 1, main + restarts (runs 9+10)", memkv_runs(tp2, tp2fs)
    )
    for name, label in (
        ("run11-x2host-tp1-main.json", "TP=1 on the 32-vCPU host, step_yield_ms 1 (run 11)"),
        ("run12-x2host-tp1-noyield-main.json", "TP=1 on the 32-vCPU host, step_yield_ms 0 (run 12)"),
    ):
        if name in docs:
            rr = [
                r
                for r in runs_of(docs[name], "main", None, 32768)
                if r["phase"] in ("memkv", "recompute") and r["timeline"].get("load_job_s")
            ]
            bd[label] = breakdown_row(label, rr)
    cpu1 = s1[32768]["cpu_hit"]
    cpu2 = s2[32768]["cpu_hit"]
    print(
        f"| CPU-pool hit, TP=1 / TP=2 | - | - | - | - | {med(cpu1) * 1e3:.0f} / {med(cpu2) * 1e3:.0f} ms | "
        f"{med(cpu1):.2f} / {med(cpu2):.2f} s | - |"
    )
    if before:
        print()
        for r in runs_of(before, "main", "memkv") + runs_of(before, "restart", "restart_memkv"):
            tl = r["timeline"]
            retry = sum(v for k, v in r.get("tier_counters", {}).items() if "lookups{retry}" in k)
            print(
                f"- run 8 {r['phase']} {r['tokens']}: exists round {fmt(tl.get('exists_round_s', []))} s, "
                f"{int(retry):,} RETRY answers, load {'yes' if tl.get('load_job_s') else 'NO (lookup deadline: MISS)'}"
            )
        for r in runs_of(tp2, "main", "memkv"):
            tl = r["timeline"]
            retry = sum(v for k, v in r.get("tier_counters", {}).items() if "lookups{retry}" in k)
            print(
                f"- run 9 {r['phase']} {r['tokens']}: exists round {fmt(tl.get('exists_round_s', []))} s, "
                f"{int(retry):,} RETRY answers"
            )

    sw = tp1["engines"]["main"].get("sweep") or []
    if sw:
        print("\n### Sweep (run 6, TP=1, 32k-token promotion, two repetitions)\n")
        print("| read threads | blocks_per_op | client receive chunk | promotion |")
        print("|---:|---:|---:|---|")
        for s in sw:
            print(
                f"| {s['threads']} | {s['blocks_per_op']} | {s.get('verify_chunk_mib') or 16} MiB | {fmt(s['seconds'])} s |"
            )
    xf = os.path.join(args.results, "xfer-run6.json")
    if os.path.exists(xf):
        with open(xf) as f:
            x = json.load(f)
        print(
            f"\n### xfer.py, same host as run 6 ({x['args']['values']} x {x['args']['value_mib']} MiB from "
            f"{x['args']['nodes']} nodes into a {x['buffer']} buffer; put {x['put']['gbps']:.1f} GB/s; host->GPU copy "
            f"{max(h['gbps'] for h in x.get('h2d', [{'gbps': 0}])):.1f} GB/s)\n"
        )
        print("| variant | seconds (3 reps) | GB/s (median) |")
        print("|---|---|---:|")
        for v in x["variants"]:
            print(f"| {v['variant']} | {fmt(v['seconds'])} | {v['gbps_median']:.1f} |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.4), gridspec_kw={"width_ratios": [1, 1, 1.1]})
    kvpt = tp1["meta"]["kv_bytes_per_token"]
    plot_phases(axes[0], s1, kvpt, "TP=1, one H200: vLLM 0.25.0, Qwen2.5-32B shape")
    plot_phases(axes[1], s2, kvpt, "TP=2, two H200: vLLM 0.25.0, Qwen2.5-32B shape")
    plot_stages(axes[2], bd)
    save(fig, args.img)
    return 0


def history(args) -> int:
    docs = load(args.results)
    r1 = docs["run1-4nodes-main-restart.json"]
    r2 = docs.get("run2-fs-restart.json")
    r4 = docs.get("run4-chunk-main-restart.json")
    kvpt = r1["meta"]["kv_bytes_per_token"]

    series = ttft_table(r1, r2)
    if r4:
        for L in LENGTHS:
            series[L]["memkv_c4"] = [r["seconds"] for r in runs_of(r4, "main", "memkv", L)]
            series[L]["restart_c4"] = [r["seconds"] for r in runs_of(r4, "restart", "restart_memkv", L)]
    if r4:
        print()
        print("Experiment (run 4, client receive/verify chunk patched from 1 MiB to 4 MiB, same settings otherwise):")
        print()
        print("| prompt tokens | recompute | CPU-pool hit | MemKV promotion | MemKV after restart |")
        print("|---:|---|---|---|---|")
        for L in (32768, 65536):
            print(
                f"| {L:,} | {fmt([r['seconds'] for r in runs_of(r4, 'main', 'recompute', L)])} s "
                f"| {fmt([r['seconds'] for r in runs_of(r4, 'main', 'cpu_hit', L)])} s "
                f"| {fmt(series[L]['memkv_c4'])} s | {fmt(series[L]['restart_c4'])} s |"
            )

    # ---- breakdown ---------------------------------------------------------------------------------
    print()
    print(
        "| 32,768-token promotion | lookup (exists round + steps) | MemKV -> CPU pool | job noticed "
        "| CPU pool -> GPU + last block + token | total | MemKV -> pool rate |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = [
        ("MemKV, run 1 (main)", runs_of(r1, "main", "memkv", 32768)),
        (
            "MemKV after restart, runs 1+2",
            runs_of(r1, "restart", "restart_memkv", 32768)
            + (runs_of(r2, "restart", "restart_memkv", 32768) if r2 else []),
        ),
    ]
    if r4:
        rows.append(
            (
                "MemKV, 4 MiB chunks (run 4 main+restart)",
                runs_of(r4, "main", "memkv", 32768) + runs_of(r4, "restart", "restart_memkv", 32768),
            )
        )
    bd_plot = {}
    for label, rr in rows:
        bds = [breakdown(r) for r in rr]
        m = {k: med([b[k] for b in bds]) for k in ("lookup", "transfer", "notice", "to_gpu", "total")}
        g = med([b["gbps"] for b in bds if b["gbps"]])
        bd_plot[label] = m
        print(
            f"| {label} (n={len(bds)}) | {m['lookup'] * 1e3:.0f} ms | {m['transfer'] * 1e3:.0f} ms "
            f"| {m['notice'] * 1e3:.0f} ms | {m['to_gpu'] * 1e3:.0f} ms | {m['total']:.2f} s | {g:.1f} GB/s |"
        )
    cpu32 = [r["seconds"] for r in runs_of(r1, "main", "cpu_hit", 32768)] + (
        [r["seconds"] for r in runs_of(r2, "fs", "cpu_hit", 32768)] if r2 else []
    )
    print(
        f"| CPU-pool hit (runs 1+2, n={len(cpu32)}) | - | - | - | {med(cpu32) * 1e3:.0f} ms | {med(cpu32):.2f} s | - |"
    )
    if r2:
        fsr = runs_of(r2, "fs", "fs", 32768)
        f_sub = med([r["timeline"].get("first_submit_load_s", 0) for r in fsr])
        f_taken = med([r["timeline"].get("last_job_taken_s", 0) for r in fsr])
        f_tot = med([r["seconds"] for r in fsr])
        bd_plot["fs tier (run 2)"] = {
            "lookup": f_sub,
            "transfer": f_taken - f_sub,
            "notice": 0.0,
            "to_gpu": f_tot - f_taken,
            "total": f_tot,
        }
        print(
            f"| fs tier (run 2, n={len(fsr)}) | {f_sub * 1e3:.0f} ms "
            f"| {(f_taken - f_sub) * 1e3:.0f} ms (disk -> pool, until taken) "
            f"| - | {(f_tot - f_taken) * 1e3:.0f} ms | {f_tot:.2f} s | {8 * 2**30 / (f_taken - f_sub) / 1e9:.1f} GB/s |"
        )
    ex = [breakdown(r) for r in runs_of(r1, "main", "memkv", 32768)]
    print()
    print(
        f"exists rounds per promotion: {sorted({b['exists_rounds'] for b in ex})}, round times "
        f"{[b['exists_round_ms'] for b in ex]} ms"
    )

    # ---- sweeps --------------------------------------------------------------------------------------
    print()
    print(
        "| run | nodes | read threads | blocks_per_op | GIL switch interval | receive/verify chunk | 32k promotion (2 reps) |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, doc in docs.items():
        sw = doc["engines"].get("main", {}).get("sweep")
        if not sw:
            continue
        nodes = len(doc["meta"].get("memkv_nodes", []))
        for s in sw:
            print(
                f"| {name.split('-')[0]} | {nodes} | {s['threads']} | {s['blocks_per_op']} | "
                f"{s['switch_interval_ms'] or 5} ms | {s.get('verify_chunk_mib') or 1} MiB | {fmt(s['seconds'])} s |"
            )

    xf = os.path.join(args.results, "xfer.json")
    if os.path.exists(xf):
        with open(xf) as f:
            x = json.load(f)
        print()
        print(
            f"xfer.py ({x['args']['values']} x {x['args']['value_mib']} MiB from {x['args']['nodes']} nodes into a "
            f"{x['buffer']} buffer; put {x['put']['gbps']:.1f} GB/s; host->GPU copy "
            f"{max(h['gbps'] for h in x.get('h2d', [{'gbps': 0}])):.1f} GB/s)"
        )
        print()
        print("| variant | seconds (3 reps) | GB/s (median) |")
        print("|---|---|---:|")
        for v in x["variants"]:
            print(f"| {v['variant']} | {fmt(v['seconds'])} | {v['gbps_median']:.1f} |")

    # ---- plot ------------------------------------------------------------------------------------------
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5.2), gridspec_kw={"width_ratios": [1.25, 1]})
    plot_phases(ax, series, kvpt, "Revisited prompt on vLLM 0.25.0, H200, Qwen2.5-32B shape")
    cpu_row = {"lookup": 0, "transfer": 0, "notice": 0, "to_gpu": med(cpu32), "total": med(cpu32)}
    plot_stages(bx, {**bd_plot, "CPU-pool hit": cpu_row})
    save(fig, args.img)
    return 0


# ---- 2026-12-01: the defaults (runs 13-15) ------------------------------------------------------------

DEFAULT_BARS = [
    ("recompute", "recompute (cold, first sight)", "#b0b0b0"),
    ("restart", "MemKV after engine restart", "#7aa6d6"),
    ("memkv", "MemKV promotion", "#2a6db5"),
    ("cpu_hit", "CPU-pool hit", "#5aa55a"),
]
SERVE_BARS = [("cold", "cold (recompute)", "#b0b0b0"), ("after_restart", "after server restart (MemKV)", "#7aa6d6")]
GIB = 2**30


def served(rr: list) -> str:
    """The nodes' sent bytes of promotion runs against each run's KV bytes."""
    if not rr:
        return "-"
    whole = sum(1 for r in rr if r.get("memkv_sent_bytes", 0) >= r["prompt_kv_bytes"])
    vals = sorted({round(r.get("memkv_sent_bytes", 0) / GIB, 2) for r in rr})
    amount = " / ".join(f"{v:g}" for v in vals)
    return f"{amount} GiB per run, {whole} of {len(rr)} runs whole"


def defaults_table(doc: dict) -> dict:
    kvpt = doc["meta"]["kv_bytes_per_token"]
    print(
        "| prompt tokens | KV bytes | recompute | CPU-pool hit | MemKV promotion | MemKV after restart "
        "| recompute / MemKV | bytes served by the nodes (promotion + restart) |"
    )
    print("|---:|---:|---|---|---|---|---:|---|")
    series = {}
    for L in LENGTHS:
        rec = [r["seconds"] for r in runs_of(doc, "main", "recompute", L)]
        cpu = [r["seconds"] for r in runs_of(doc, "main", "cpu_hit", L)]
        mk_runs = runs_of(doc, "main", "memkv", L)
        rs_runs = runs_of(doc, "restart", "restart_memkv", L)
        mk = [r["seconds"] for r in mk_runs]
        rs = [r["seconds"] for r in rs_runs]
        series[L] = {"recompute": rec, "cpu_hit": cpu, "memkv": mk, "restart": rs, "memkv_all": mk + rs}
        ratio = f"{med(rec) / med(mk + rs):.1f}x" if rec and mk + rs else "-"
        print(
            f"| {L:,} | {L * kvpt / GIB:g} GiB | {fmt(rec)} s | {fmt(cpu)} s | {fmt(mk)} s | {fmt(rs)} s "
            f"| {ratio} | {served(mk_runs + rs_runs)} |"
        )
    return series


def serve_table(doc: dict) -> dict:
    """vllm serve, cold vs after a restart of the server on the same nodes (run 14)."""
    prompts = doc["prompts"]
    lengths = sorted({p["tokens"] for p in prompts})
    print(
        "| prompt tokens | KV bytes | cold TTFT | TTFT after restart | MemKV bytes served by the nodes "
        "| `vllm:kv_offload_memkv_load_bytes` (server /metrics) | cached tokens (usage, cold / after) | output |"
    )
    print("|---:|---:|---|---|---|---|---|---|")
    series = {}
    for L in lengths:
        pp = [p for p in prompts if p["tokens"] == L]
        cold = [p for p in pp if p["phase"] == "cold"]
        rest = [p for p in pp if p["phase"] == "after_restart"]
        series[L] = {"cold": [p["ttft_s"] for p in cold], "after_restart": [p["ttft_s"] for p in rest]}
        kv = pp[0]["prompt_kv_bytes"]
        sent = " / ".join(f"{p['memkv_sent_bytes'] / GIB:g}" for p in rest)
        metric = " / ".join(f"{(p.get('server_memkv_load_bytes') or 0) / GIB:g}" for p in rest)
        cached = " / ".join(str(p["usage"]["prompt_tokens_details"]["cached_tokens"]) for p in cold + rest)
        outs = {(tuple(p["token_ids"]), json.dumps(p["top5"])) for p in pp}
        same = "identical (token and top-5)" if len(outs) == 1 else f"DIFFERS ({len(outs)} variants)"
        print(
            f"| {L:,} | {kv / GIB:g} GiB | {fmt(series[L]['cold'])} s | {fmt(series[L]['after_restart'])} s "
            f"| {sent} GiB | {metric} GiB | {cached} | {same} |"
        )
    print()
    for s in doc["servers"]:
        fm = s.get("final_metrics", {})
        keys = [
            k
            for k in fm
            if k.startswith("vllm:kv_offload_memkv_")
            and "bucket" not in k
            and "created" not in k
            and "job_seconds" not in k
        ]
        print(
            f"- server `{s['role']}` (healthy after {s['start_s']:.0f} s), /metrics at its end: "
            + ", ".join(f"`{k}` {fm[k] / GIB:.3f} GiB" if "bytes" in k else f"`{k}` {fm[k]:g}" for k in keys)
            + (
                ""
                if any("sheds" in k or "jobs_failed" in k for k in keys)
                else " (no `..._sheds` or `..._jobs_failed` series: a series appears with its first count, so nothing "
                "was shed and no job failed)"
            )
        )
    return series


def cold_table(with_tier: dict, without: dict) -> None:
    """Issue 16 item 3: the first (recompute) run with the MemKV tier vs the same engine shape
    without a secondary tier. Repetitions 0 and 1 are the same prompts in both runs."""
    print(
        "| prompt tokens | with the MemKV tier (run 13) | without a secondary tier (run 15) "
        "| with / without (medians) | same prompt, with / without |"
    )
    print("|---:|---|---|---:|---|")
    for L in LENGTHS:
        a = {r["rep"]: r["seconds"] for r in runs_of(with_tier, "main", "recompute", L)}
        b = {r["rep"]: r["seconds"] for r in runs_of(without, "notier", "recompute_notier", L)}
        if not a or not b:
            continue
        pair = " / ".join(f"{a[k] / b[k]:.3f}" for k in sorted(a) if k in b)
        print(
            f"| {L:,} | {fmt(list(a.values()))} s | {fmt(list(b.values()))} s "
            f"| {med(list(a.values())) / med(list(b.values())):.3f} | {pair} |"
        )


def defaults(args) -> int:
    docs = load(args.results, DEFAULTS)
    d13 = docs["run13-defaults-mp-main-restart.json"]
    d14 = docs.get("run14-serve-readme.json")
    d15 = docs.get("run15-notier.json")
    m = d13["meta"]
    print(
        f"### Defaults: {m['host']['date_utc']}, {m['host']['gpu']}, {m['host']['cpus']} vCPUs, tier "
        f"`{json.dumps(m['memkv_tier'])}`, {m['process_layout']} (run 13)\n"
    )
    s13 = defaults_table(d13)
    bad = d13.get("output_mismatches") or []
    orig = d13.get("origin_errors") or []
    print(f"\noutput mismatches: {len(bad)}, origin errors: {len(orig)}")
    s14 = None
    if d14:
        print("\n### `vllm serve` with README's --kv-transfer-config, restarted on the same nodes (run 14)\n")
        s14 = serve_table(d14)
        print(f"\nfailures: {len(d14.get('failures') or [])}, README config verbatim: {d14['meta']['readme_verbatim']}")
    if d15:
        print("\n### Cold runs: with the tier vs without a secondary tier (runs 13 + 15)\n")
        cold_table(d13, d15)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kvpt = m["kv_bytes_per_token"]
    ratios = {L: f"recompute / MemKV {med(s13[L]['recompute']) / med(s13[L]['memkv_all']):.1f}x" for L in LENGTHS}
    if s14:
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5.4), gridspec_kw={"width_ratios": [1.45, 1]})
    else:
        fig, ax = plt.subplots(1, 1, figsize=(8.5, 5.4))
    plot_phases(
        ax,
        s13,
        kvpt,
        "Defaults: README's tier config, engine core in its own process\n"
        "(1x H200, 16 vCPUs, vLLM 0.25.0, Qwen2.5-32B shape, 4 MemKV nodes on loopback)",
        bars_spec=DEFAULT_BARS,
        ranges=True,
        tick_extra=ratios,
        width=0.2,
    )
    if s14:
        lengths = sorted(s14)
        r14 = {L: f"{med(s14[L]['cold']) / med(s14[L]['after_restart']):.1f}x faster" for L in lengths}
        plot_phases(
            bx,
            s14,
            kvpt,
            "`vllm serve`, README's --kv-transfer-config verbatim\n"
            "(streamed completions; server restarted on the same nodes)",
            bars_spec=SERVE_BARS,
            lengths=lengths,
            tick_extra=r14,
            width=0.3,
        )
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    ax.set_ylabel("time to first token, s (median, whiskers min-max; log scale)")
    for a in (ax, bx) if s14 else (ax,):  # one scale for both panels, plain seconds on it
        a.set_ylim(0.07, 16)
        a.yaxis.set_major_locator(FixedLocator([0.1, 0.2, 0.5, 1, 2, 5, 10]))
        a.yaxis.set_major_formatter(lambda v, _: f"{v:g}")
        a.yaxis.set_minor_locator(NullLocator())
        a.yaxis.set_minor_formatter(NullFormatter())
    save(fig, args.img)
    return 0


# 2026-12-01 evening: the stage breakdown in vLLM's default layout (tier_probe.py in the engine core).
BREAKDOWN = "run17-defaults-breakdown-main-restart.json"
TARGETS = {8192: 0.2, 32768: 0.5, 65536: 0.9}  # issue 16's promotion targets


# 2026-12-02 afternoon: TCP and RDMA engines side by side in one call (run 34), README's config.
TRANSPORTS = {"run34-tcp-main-restart.json": "TCP", "run34-rdma-main-restart.json": "RDMA"}
# 2026-12-03: TCP, RDMA (one RDMA_GET per node and batch) and RDMA with 16 MiB pipelined parts (run 39).
PIPELINE = {
    "run39-tcp-main.json": "TCP",
    "run39-rdma0-main.json": "RDMA",
    "run39-rdma16-main.json": "RDMA, 16 MiB parts",
}
# 2026-12-03: loopback TCP (MEMKV_LOCAL_SOCKET=off) vs the same-host socket (the default), on two
# machines, each pair one call after the other on the same machine (runs 43-44 and 46-47).
LOCAL = {
    "run44-tcp-main.json": "host A, TCP",
    "run43-local-main-restart.json": "host A, same-host socket",
    "run47-tcp-main.json": "host B, TCP",
    "run46-local-main-notier.json": "host B, same-host socket",
}
# 2026-12-04: shared memory on by default (runs 54 and 56, commit 3684015) and MEMKV_SHARED_MEMORY=off
# (run 55) on one machine, in the order 54, 55, 56 (calls back to back).
SHM_DEFAULT = {
    "run54-defaults-main-restart-notier.json": "run 54, default",
    "run55-shm-off-main-restart.json": "run 55, shared memory off",
    "run56-defaults-main-restart.json": "run 56, default",
}


def breakdown_plot(args) -> int:
    """Stacked bars of run 17's per-run stages (medians per prompt length and engine), with the
    CPU-pool hit and the targets marked: docs/img/gpu-breakdown-defaults.png."""
    return stages_plot(
        args,
        {BREAKDOWN: ""},
        "Where a promotion's time goes with README's tier config, engine core in its own process\n"
        "(run 17: 1x H200, 16 vCPUs, vLLM 0.25.0, 32B shape, 4 MemKV nodes on loopback, TCP)",
    )


def transports_plot(args) -> int:
    """The same stages for run 34's TCP and RDMA engines (one call, one host):
    docs/img/gpu-breakdown-transports.png."""
    return stages_plot(
        args,
        TRANSPORTS,
        "A promotion's stages, TCP vs RDMA (UCX cma) in one call, README's tier config\n"
        "(run 34: 1x H200, 16 vCPUs, vLLM 0.25.0, 32B shape, 4 MemKV nodes on loopback)",
    )


def local_plot(args) -> int:
    """Runs 43-47: TCP vs the same-host socket, per host: docs/img/gpu-breakdown-local.png."""
    return stages_plot(
        args,
        LOCAL,
        "A promotion's stages: loopback TCP vs the nodes' same-host (Unix) socket, README's tier config\n"
        "(runs 43-47: 1x H200, 16 vCPUs, vLLM 0.25.0, 32B shape, 4 MemKV nodes; two machines, A and B)",
    )


def shm_plot(args) -> int:
    """Runs 54-56: shared memory on by default vs off, one machine: docs/img/gpu-breakdown-shm.png."""
    return stages_plot(
        args,
        SHM_DEFAULT,
        "A promotion's stages with the defaults (shared memory on) and with it off, README's tier config\n"
        "(runs 54-56: 1x H200, 16 vCPUs, vLLM 0.25.0, 32B shape, 4 MemKV nodes on loopback, one machine)",
    )


def pipeline_plot(args) -> int:
    """Run 39's three engines (one call, fresh nodes each): docs/img/gpu-breakdown-pipeline.png."""
    return stages_plot(
        args,
        PIPELINE,
        "A promotion's stages: TCP, RDMA, RDMA with pipelined 16 MiB RDMA_GETs, one call\n"
        "(run 39: 1x H200, 16 vCPUs, vLLM 0.25.0, 32B shape, 4 MemKV nodes on loopback, UCX cma)",
    )


def stages_plot(args, files: dict, title: str) -> int:
    """One stacked bar per (prompt length, engine, file): the medians of each stage."""
    docs = load(args.results, files)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [
        ("lookup_s", "lookup", "#999999"),
        ("memkv_to_pool_s", "MemKV -> CPU pool", "#2a6db5"),
        ("pool_to_gpu_token_s", "CPU pool -> GPU, last block, token", "#5aa55a"),
    ]
    labels, meds, hits = [], [], []
    print("| run | " + " | ".join(n for _, n, _ in stages) + " | total |\n|---|" + "---:|" * (len(stages) + 1))
    for L in LENGTHS:
        for eng, name in (("main", "promotion"), ("restart", "after restart")):
            for fname, tag in files.items():
                rr = [r for r in docs[fname]["breakdown"] if r["tokens"] == L and r["engine"] == eng]
                if not rr:
                    continue
                labels.append(f"{L // 1024}k, {name}" + (f", {tag}" if tag else ""))
                meds.append(
                    {k: med([r[k] for r in rr if r.get(k) is not None]) or 0.0 for k, _, _ in stages}
                    | {"total": med([r["total_s"] for r in rr]), "tokens": L}
                )
                hits.append(rr[0]["cpu_hit_s"])
                print(
                    f"| {labels[-1]} | "
                    + " | ".join(f"{meds[-1][k]:.3f}" for k, _, _ in stages)
                    + f" | {meds[-1]['total']:.3f} |"
                )
    fig, ax = plt.subplots(1, 1, figsize=(9, 2.0 + 0.45 * len(labels)))
    for yi, m in enumerate(meds):
        left = 0.0
        for k, name, color in stages:
            ax.barh(yi, m[k], left=left, color=color, label=name if yi == 0 else None)
            left += m[k]
        ax.text(m["total"] + 0.02, yi, f"{m['total']:.2f} s", va="center", fontsize=8)
        ax.plot(
            [TARGETS[m["tokens"]]] * 2, [yi - 0.4, yi + 0.4], color="red", lw=1.5, label="target" if yi == 0 else None
        )
        ax.plot(
            [hits[yi]] * 2,
            [yi - 0.4, yi + 0.4],
            color="black",
            ls=":",
            lw=1.2,
            label="CPU-pool hit" if yi == 0 else None,
        )
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (median of 2)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=5)
    ax.set_xlim(0, max(m["total"] for m in meds) * 1.12)
    save(fig, args.img)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
