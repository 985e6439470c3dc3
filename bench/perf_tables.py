#!/usr/bin/env python3
"""Writes the tables of docs/performance.md from the benchmarks' JSON files.

  python3 bench/perf_tables.py            # rewrite every table of the page in place
  python3 bench/perf_tables.py --check    # exit 1 (and show the difference) if the page is stale

A table sits between `<!-- table: NAME -->` and `<!-- /table -->`; everything else on the page is
prose and stays as written. Each table names its source files, the machine, the date (from the
JSON) and the commit whose code ran (from COMMITS below: the JSON files do not record it), so a
figure can be traced and re-measured. Standard library only.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "performance.md"
VM_RESULTS = "bench/results"
GPU_RESULTS = "bench/gpu/results"

MEMFD = f"{VM_RESULTS}/shm_memfd_2026-12-06/memfd_b{{b}}_{{i}}"  # the current design, 1 or 8 values per request
MEMFD_COMMIT = "133b63c"
# The data path on the H100 host (16 vCPUs, no huge pages for shared memory): (label, file, commit).
H100_DATAPATH = [
    (
        "memfds with spares (on there: `auto`), commit 1499605",
        f"{GPU_RESULTS}/datapath-h100-2026-12-06/new.json",
        "1499605",
    ),
    (
        "memfds without spares, commit 2072e52 (another machine)",
        f"{GPU_RESULTS}/datapath-h100-2026-12-06/no-spares-2072e52/new_2.json",
        "2072e52",
    ),
]


def shm_files(b: int, invocations: tuple[int, ...]) -> list[str]:
    return [f"{MEMFD.format(b=b, i=i)}.json" for i in invocations]


# Lookups under a store storm, the storers at nice 0 and at the tier's store_nice, alternating.
VM_STORM = [f"{VM_RESULTS}/fleet_storm_nice_2026-12-07/vm_nice{n}_{i}.json" for i in (1, 2) for n in (0, 10)]


# Same-host stores without huge pages for shared memory: the node writing its own reused memfds
# (`--shared-memory-stores auto`, node on this host) and the clients writing fresh ones (`client`),
# alternating, 1 and 8 values per request, twice.
NODE_WRITTEN = [
    f"{VM_RESULTS}/shm_node_written_2026-12-07/{who}_b{b}_{i}.json"
    for b in (1, 8)
    for i in (1, 2)
    for who in ("node", "client")
]
NODE_WRITTEN_COMMIT = "da858b6"
# The same in the fleet: co-located, node-written (default here) then client-written memfds.
FLEET_NODE_WRITTEN = [f"{VM_RESULTS}/fleet_colocated_node_written_2026-12-07/{who}.json" for who in ("node", "client")]


# Source file -> the commit whose code produced it (the JSON records date and machine, not this).
COMMITS = {
    **{path: MEMFD_COMMIT for b in (1, 8) for path in shm_files(b, (1, 2))},
    **{path: commit for _, path, commit in H100_DATAPATH},
    f"{GPU_RESULTS}/run84-h100-ttft-colocated-vs-off-raw/colocated.json": "3cee6e4",
    f"{GPU_RESULTS}/run84-h100-ttft-colocated-vs-off-raw/local-socket-off.json": "3cee6e4",
    f"{GPU_RESULTS}/run86-h100-ttft-colocated-32k/ttft-main-restart.json": "3cee6e4",
    f"{GPU_RESULTS}/run90-h100-ttft-colocated-vs-off-raw-32k/colocated.json": "a191328",
    f"{GPU_RESULTS}/run90-h100-ttft-colocated-vs-off-raw-32k/local-socket-off.json": "a191328",
    f"{VM_RESULTS}/datapath_2026-12-05/memory.json": "159889a",
    f"{VM_RESULTS}/fleet_2026-12-07-steady/fleet.json": "fc51a79",
    f"{GPU_RESULTS}/run82-h200-datapath-fleet/dp8.json": "b6c12e9",
    f"{GPU_RESULTS}/run82-h200-datapath-fleet/dp1.json": "b6c12e9",
    f"{GPU_RESULTS}/run82-h200-datapath-fleet/fleet.json": "b6c12e9",
    f"{GPU_RESULTS}/run94-h100-fleet-loopback/fleet.json": "4c49a4b",
    f"{GPU_RESULTS}/run54-defaults-main-restart-notier.json": "3684015",
    f"{GPU_RESULTS}/run78-h200-ttft-colocated-vs-off/colocated.json": "59f7136",
    f"{GPU_RESULTS}/run78-h200-ttft-colocated-vs-off/local-socket-off.json": "59f7136",
    **{path: "6724ae8" for path in VM_STORM},
    **{path: NODE_WRITTEN_COMMIT for path in NODE_WRITTEN},
    **{path: "a75c3c0" for path in FLEET_NODE_WRITTEN},
}

# The datapath bench's systems: what each is, and the raw design on the same transport.
DATAPATH_SYSTEMS = {
    "memkv-shm": ("co-located: shared memory (the default)", "raw-unix"),
    "memkv": ("same-host socket (`MEMKV_SHARED_MEMORY=off`)", "raw-unix"),
    "memkv-tcp": ("TCP on loopback (`MEMKV_LOCAL_SOCKET=off`)", "raw"),
    "raw-unix": ("raw design, Unix socket (no MemKV)", None),
    "raw": ("raw design, TCP (no MemKV)", None),
}


def load(path: str) -> dict:
    return json.loads((REPO / path).read_text())


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def ratio(xs: list[float]) -> str:
    """A block-median ratio over the repetitions: median (min-max)."""
    return f"{med(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def machine(doc: dict) -> str:
    m = doc.get("machine") or doc.get("meta", {}).get("machine", "")
    if m.startswith("vm x86_64 2 cpus") or m == "vm (2 CPUs)":
        return "the 2-vCPU VM"
    return m


def when(doc: dict) -> str:
    """The run's date, as `YYYY-MM-DD HH:MM UTC` (the benches write the VM's clock, which is UTC)."""
    meta = doc.get("meta", {})
    d = doc.get("date") or doc.get("when") or meta.get("date") or meta["host"]["date_utc"]
    return d if d.endswith(" UTC") else d[:16] + " UTC"


def source_line(paths: list[str], what: str, where: str = "") -> str:
    docs = [load(p) for p in paths]
    dates = sorted({when(d) for d in docs})
    span = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    commits = ", ".join(dict.fromkeys(COMMITS[p] for p in paths))
    files = ", ".join(f"`{p}`" for p in paths)
    return f"{what}; {where or machine(docs[0])}, {span}, commit {commits}; source: {files}."


def table(header: list[str], rows: list[list[str]], right: int = 0) -> list[str]:
    """Markdown table; the last `right` columns right-aligned."""
    align = ["---"] * (len(header) - right) + ["---:"] * right
    return ["| " + " | ".join(r) + " |" for r in [header, align, *rows]]


# ------------------------------------------------------------------------------------------------
# The 2-vCPU VM
# ------------------------------------------------------------------------------------------------


def datapath_rows(d: dict, label_suffix: str = "") -> list[list[str]]:
    rows = []
    for system, (label, base) in DATAPATH_SYSTEMS.items():
        g, c, r = d["gbps"], d["cpu_s_per_gb"], d["block_median_ratios"]
        vs = "1" if base is None else f"{ratio(r[f'{system}/{base} put'])} / {ratio(r[f'{system}/{base} get'])}"
        rows.append(
            [
                label + label_suffix,
                f"{med(g[system + ' put']):.2f} / {med(g[system + ' get']):.2f}",
                f"{med(c[system + ' put']):.2f} / {med(c[system + ' get']):.2f}",
                vs if base is None else f"{vs} of `{base}`",
            ]
        )
    return rows


DATAPATH_HEADER = [
    "client path",
    "GB/s PUT / GET",
    "CPU-s per GB PUT / GET",
    "vs the raw design on the same transport, PUT / GET: median (min-max) of the repetitions",
]


def vm_datapath() -> list[str]:
    path = shm_files(1, (1,))[0]
    d = load(path)
    what = (
        f"`python3 bench/datapath.py --no-redis --reps {d['reps']}`: {d['value_bytes'] >> 20} MiB values, "
        f"{d['threads']} threads, {d['nodes']} node, one value per request, the systems interleaved in blocks"
    )
    return [source_line([path], what), "", *table(DATAPATH_HEADER, datapath_rows(d))]


def vm_batched() -> list[str]:
    paths = shm_files(8, (1, 2))
    rows = []
    for i, path in enumerate(paths, 1):
        d = load(path)
        g, r = d["gbps"], d["block_median_ratios"]
        rows.append(
            [
                f"invocation {i}",
                f"{med(g['memkv-shm put']):.2f} / {med(g['memkv-shm get']):.2f}",
                f"{med(g['raw-unix put']):.2f} / {med(g['raw-unix get']):.2f}",
                ratio(r["memkv-shm/raw-unix put"]),
                ratio(r["memkv-shm/raw-unix get"]),
            ]
        )
    d = load(paths[0])
    what = (
        f"`python3 bench/datapath.py --no-redis --reps {d['reps']} --blocks-per-op {d['blocks_per_op']}` "
        f"{len(paths)} times: {d['value_bytes'] >> 20} MiB values, {d['blocks_per_op']} per request "
        f"(the tier's `blocks_per_op`), {d['threads']} threads, huge pages for shared memory (`shmem_enabled=advise`)"
    )
    return [
        source_line(paths, what),
        "",
        *table(
            ["", "default client GB/s PUT / GET", "raw-unix GB/s PUT / GET", "PUT vs raw-unix", "GET vs raw-unix"], rows
        ),
    ]


def vm_node_written() -> list[str]:
    rows = []
    for path in NODE_WRITTEN:
        d = load(path)
        g, c, r = d["gbps"], d["cpu_s_per_gb"], d["block_median_ratios"]
        name = path.rsplit("/", 1)[1]
        rows.append(
            [
                "the node (`auto` here)" if name.startswith("node") else "the clients (`client`)",
                f"{d['blocks_per_op']}, {d['threads']} threads, invocation {name[-6]}",
                ratio(r["memkv-shm/raw-unix put"]),
                ratio(r["memkv-shm/raw-unix get"]),
                f"{med(g['memkv-shm put']):.2f} / {med(g['memkv-shm get']):.2f}",
                f"{med(g['raw-unix put']):.2f} / {med(g['raw-unix get']):.2f}",
                f"{med(c['memkv-shm put']):.2f} / {med(c['memkv-shm get']):.2f}",
            ]
        )
    d = load(NODE_WRITTEN[0])
    what = (
        f"`python3 bench/datapath.py --no-redis --reps {d['reps']} [--blocks-per-op 8]`, then the same with "
        "`--node-args '--shared-memory-stores client'`, alternating, twice per shape: "
        f"{d['value_bytes'] >> 20} MiB values, no huge pages for shared memory (`shmem_enabled=never`)"
    )
    return [
        source_line(NODE_WRITTEN, what),
        "",
        *table(
            [
                "memfds written by",
                "values per request",
                "PUT vs raw-unix",
                "GET vs raw-unix",
                "GB/s PUT / GET",
                "raw-unix GB/s PUT / GET",
                "CPU-s per GB PUT / GET",
            ],
            rows,
        ),
    ]


def vm_fleet_node_written() -> list[str]:
    docs = [load(p) for p in FLEET_NODE_WRITTEN]
    cells = {}
    for who, d in zip(("the node (`auto` here)", "the clients (`client`)"), docs):
        for r in d["rows"]:
            cells.setdefault((r["clients"], r["nodes"]), []).append((who, r))
    rows = []
    for (k, m), found in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for who, r in found:
            put, get, first = r["put"], r["get"], r["first_put"]
            rows.append(
                [
                    str(k),
                    str(m),
                    who,
                    f"{put['memkv_gbps']:.2f} / {put['raw_gbps']:.2f}",
                    f"{put['ratio']:.2f}",
                    f"{first['ratio']:.2f}",
                    f"{get['ratio']:.2f}",
                    f"{put['node_cpu_s_per_gb']:.2f}",
                    f"{put['spread']:.2f} / {get['spread']:.2f}",
                    str(first["failures"] + put["failures"] + get["failures"]),
                ]
            )
    a = docs[0]["meta"]["args"]
    what = (
        f"`python3 bench/fleet.py --topology colocated --clients {a['clients']} --nodes {a['nodes']} --reps 1`, then the "
        "same with `--node-args '--shared-memory-stores client'`: K client processes x M nodes on one host, each "
        f"client {a['threads']} threads moving {a['values']} values of {a['value_mib']} MiB in batches of "
        f"{a['blocks_per_op']}, one repetition after the cell's first PUT round and an untimed second, raw baseline "
        f"an abstract Unix socket; no huge pages for shared memory (`shmem_enabled={docs[0]['meta']['shmem_enabled']}`)"
    )
    return [
        source_line(FLEET_NODE_WRITTEN, what),
        "",
        *table(
            [
                "K",
                "M",
                "memfds written by",
                "PUT GB/s MemKV / raw",
                "PUT vs raw",
                "first PUT round vs raw",
                "GET vs raw",
                "node CPU-s per GB PUT",
                "client max/min PUT / GET",
                "values not stored or not loaded",
            ],
            rows,
            right=3,
        ),
    ]


def vm_memory() -> list[str]:
    path = f"{VM_RESULTS}/datapath_2026-12-05/memory.json"
    d = load(path)
    rows = []
    for r in d["rows"]:
        base, final = r["baseline_rss"], r["final"]
        within = all(s["rss"] <= 1.05 * s["stored"] + base + (64 << 20) for s in r["samples"])
        rows.append(
            [
                f"{r['value_bytes'] >> 20} MiB",
                f"{r['capacity_bytes'] / (1 << 30):.0f} GiB",
                f"{(final['rss'] - base) / final['stored']:.3f}",
                "yes" if within else "**no**",
            ]
        )
    what = (
        "`python3 bench/memory.py --capacity 1GiB --sizes 4MiB,16MiB`: a node filled to 1.5x its capacity (it evicts)"
    )
    return [
        source_line([path], what),
        "",
        *table(
            [
                "value size",
                "capacity",
                "(RSS - baseline) / stored at the end",
                "RSS <= 1.05 x stored + 64 MiB at every sample",
            ],
            rows,
        ),
    ]


FLEET = f"{VM_RESULTS}/fleet_2026-12-07-steady/fleet.json"
TOPOLOGIES = {"remote": "remote (TCP)", "colocated": "co-located", "loopback": "loopback (TCP)"}
DEFAULT_TOPOLOGIES = ["remote", "colocated"]  # bench/fleet.py's --topology default
TOPOLOGY_NOTES = {
    "remote": "remote = every node in a network namespace of its own behind a veth pair (TCP, as from another "
    "host), raw baseline TCP to the same place",
    "colocated": "co-located = the client's defaults, raw baseline an abstract Unix socket",
    "loopback": "loopback = the nodes on the clients' host reached over TCP only (the clients' `local_socket` off, "
    "the path a node on another host gets, where network namespaces cannot be made), raw baseline TCP to the same "
    "address",
}


def vm_fleet() -> list[str]:
    return fleet_table(FLEET)


def vm_storm() -> list[str]:
    return storm_table(VM_STORM)


def storm_table(paths: list[str], where: str = "") -> list[str]:
    """One engine's lookups alone and while the other K-1 store, per run of `bench/fleet.py
    --lookups`, with where the time went; each cell's runs side by side (they alternate)."""
    docs = [load(path) for path in paths]
    cells = [(r["clients"], r["nodes"]) for r in docs[0]["rows"] if "lookups" in r]
    rows = []
    for k, m in cells:
        for d in docs:
            (r,) = [r for r in d["rows"] if (r["clients"], r["nodes"]) == (k, m)]
            x = r["lookups"]
            a, s = x["alone"], x["storm"]
            rows.append(
                [
                    str(k),
                    str(m),
                    str(d["meta"]["args"]["storer_nice"]),
                    f"{1e3 * a['p99_s']:.1f} / {1e3 * s['p99_s']:.1f}",
                    f"{s['p99_s'] / a['p99_s']:.1f}",
                    f"{s['max_s']:.3f}",
                    f"{1e3 * s['probe_runq_p99_s']:.1f}",
                    f"{1e3 * s['node_mean_s']:.2f} / {1e3 * s['node_p99_le_s']:g}",
                    f"{s['node_threads_waiting']:.1f}",
                    f"{100 * s['host_cpu_busy']:.0f}%",
                    f"{s['stored_gbps']:.2f}",
                ]
            )
    a = docs[0]["meta"]["args"]
    what = (
        f"`python3 bench/fleet.py --topology loopback --clients {a['clients']} --nodes {a['nodes']} --values "
        f"{a['values']} --value-mib {a['value_mib']} --reps 1 --lookups {a['lookups']} --storer-nice N`, N = 0 and "
        "10 alternating, twice: one client's batched lookups of 64 keys, 20 ms apart, alone, then while the other "
        f"K-1 clients ({a['threads']} threads each, batches of {a['blocks_per_op']}) store all their values again "
        "and again at nice N, over TCP to nodes on the same host; under the storm: the probe's threads' run-queue "
        "time per lookup, the nodes' own handling of the lookups (`memkv_node_request_seconds`), the nodes' "
        "threads runnable without a CPU (mean number)"
    )
    return [
        source_line(paths, what, where),
        "",
        *table(
            [
                "K",
                "M",
                "storers' nice",
                "lookup p99 ms: alone / under the stores",
                "under / alone",
                "worst lookup s",
                "the probe waiting for a CPU, p99 ms",
                "in the nodes: mean ms / p99 under ms",
                "node threads waiting for a CPU",
                "host CPUs busy",
                "storers' GB/s",
            ],
            rows,
            right=8,
        ),
    ]


def fleet_table(path: str, where: str = "") -> list[str]:
    d = load(path)
    first = all("first_put" in r for r in d["rows"])  # since the bench measures stores at steady state
    rows = []
    for r in d["rows"]:
        p, g, x = r["put"], r["get"], r.get("lookups")
        fails = p["failures"]
        # One client's lookups alone, then under the other K-1 clients' stores (none with K = 1).
        lookups = f"{x['alone_p99_s'] * 1000:.1f} / {x['storm_p99_s'] * 1000:.1f}" if x else "-"
        rows.append(
            [
                TOPOLOGIES[r["topology"]],
                str(r["clients"]),
                str(r["nodes"]),
                f"{p['memkv_gbps']:.2f} / {p['raw_gbps']:.2f}",
                f"{p['ratio']:.2f}",
                f"{g['memkv_gbps']:.2f} / {g['raw_gbps']:.2f}",
                f"{g['ratio']:.2f}",
                f"{p['spread']:.2f} / {g['spread']:.2f}",
                f"{p['p99_batch_s']:.2f} / {g['p99_batch_s']:.2f}",
                f"{p['node_cpu_s_per_gb']:.2f} / {p['raw_cpu_s_per_gb']:.2f}",
                lookups,
                str(fails) if fails else "",
            ]
        )
        if first:
            f = r["first_put"]
            refused = f", {f['failures']} not stored" if f["failures"] else ""
            rows[-1][5:5] = [f"{f['memkv_gbps']:.2f} / {f['raw_gbps']:.2f}, {f['node_cpu_s_per_gb']:.1f}{refused}"]
    a = d["meta"]["args"]
    topologies = list(dict.fromkeys(r["topology"] for r in d["rows"]))
    command = f"`python3 bench/fleet.py --lookups {a['lookups']}"
    if topologies != DEFAULT_TOPOLOGIES:
        command += f" --topology {','.join(topologies)} --clients {a['clients']} --reps {a['reps']}"
    reps = "one repetition" if str(a["reps"]) == "1" else f"median of {a['reps']} repetitions"
    if first:
        reps += (
            " after the cell's first PUT round (its own column) and an untimed second one, so that the measured "
            "stores reuse the node's freed buffers as a full node does"
        )
    what = (
        f"{command}`: K client processes x M nodes, each client {a['threads']} threads moving {a['values']} values "
        f"of {a['value_mib']} MiB in batches of {a['blocks_per_op']} (the tier's shape), {reps}; "
        + "; ".join(TOPOLOGY_NOTES[t] for t in topologies)
        + f"; lookups: one client's {a['lookups']} batched lookups of 64 keys, 20 ms apart, alone, then while the "
        "other K-1 clients store all their values again and again"
    )
    return [
        source_line([path], what, where),
        "",
        *table(
            [
                "topology",
                "K",
                "M",
                "PUT GB/s MemKV / raw",
                "PUT vs raw",
                *(["first PUT round: GB/s MemKV / raw, node CPU-s per GB"] if first else []),
                "GET GB/s MemKV / raw",
                "GET vs raw",
                "client max/min PUT / GET",
                "p99 batch s PUT / GET",
                "server CPU-s per GB PUT: node / raw",
                "lookup p99 ms: alone / under the stores",
                "values not stored",
            ],
            rows,
            right=12 if first else 11,
        ),
    ]


# ------------------------------------------------------------------------------------------------
# The H100 host (bench/gpu/ttft.py)
# ------------------------------------------------------------------------------------------------

H100_RUNS = [
    (
        f"{GPU_RESULTS}/run84-h100-ttft-colocated-vs-off-raw/colocated.json",
        "84, co-located",
        "co-located: the defaults (4 nodes on the engine's host)",
    ),
    (
        f"{GPU_RESULTS}/run84-h100-ttft-colocated-vs-off-raw/local-socket-off.json",
        "84, TCP",
        "TCP on loopback (`MEMKV_LOCAL_SOCKET=off`: the path to a node on another host)",
    ),
    (
        f"{GPU_RESULTS}/run86-h100-ttft-colocated-32k/ttft-main-restart.json",
        "86, co-located",
        "co-located again, 32k only (the next call on the same machine)",
    ),
    (
        f"{GPU_RESULTS}/run90-h100-ttft-colocated-vs-off-raw-32k/colocated.json",
        "90, co-located",
        "co-located, 32k only (another machine, later)",
    ),
    (
        f"{GPU_RESULTS}/run90-h100-ttft-colocated-vs-off-raw-32k/local-socket-off.json",
        "90, TCP",
        "TCP on loopback, 32k only (the same call as run 90, co-located)",
    ),
]
H100_TOKENS = (8192, 32768)


def paired_ttft(runs: list[tuple[str, str, str]], tokens: tuple[int, ...]) -> list[str]:
    """Co-located and TCP runs of one call on one machine: main and restarted engine, baselines."""
    rows = []
    for path, run, label in runs:
        d = load(path)
        rows.append(
            [
                f"{label}: run {run}, commit {COMMITS[path]}",
                "main",
                *[pair(seconds(d, "main", "memkv", t)) for t in tokens],
            ]
        )
        rows.append(["", "restarted", *[pair(seconds(d, "restart", "restart_memkv", t)) for t in tokens]])
    for path, run, _ in runs:
        d = load(path)
        rows.append(
            [f"recompute (no cache), run {run}", "", *[pair(seconds(d, "main", "recompute", t)) for t in tokens]]
        )
    for path, run, _ in runs:
        d = load(path)
        rows.append(
            [f"vLLM's own CPU-pool hit, run {run}", "", *[pair(seconds(d, "main", "cpu_hit", t)) for t in tokens]]
        )
    ref = load(runs[0][0])
    host, a = ref["meta"]["host"], ref["meta"]["args"]
    what = (
        f"`python3 bench/gpu/ttft.py --phases {a['phases']} --tokens {','.join(map(str, tokens))} "
        f"--gpu-util {a['gpu_util']}` then the same with `MEMKV_LOCAL_SOCKET=off`, both in one call on one "
        "machine, each with its own baselines: time to first token of a revisited "
        "prompt, the two repetitions (a promotion the nodes did not serve whole left out), seconds; "
        f"{host['cpus']} vCPUs, vLLM "
        f"{ref['engines']['main']['versions']['vllm']}, {a['nodes']} nodes on the same host"
    )
    sizes = [
        f"{t // 1024}k tokens ({t // 4096} GiB)" if i == 0 else f"{t // 1024}k ({t // 4096} GiB)"
        for i, t in enumerate(tokens)
    ]
    return [
        source_line([p for p, _, _ in runs], what, where=host["gpu"].split(",")[0]),
        "",
        *table(["client path: run", "engine", *sizes], rows),
    ]


def gpu_h100_ttft() -> list[str]:
    return paired_ttft(H100_RUNS, H100_TOKENS)


# ------------------------------------------------------------------------------------------------
# The H200 host (bench/gpu/ttft.py), 2026-12-03 and 2026-12-04
# ------------------------------------------------------------------------------------------------

H200_RUNS = [
    (
        f"{GPU_RESULTS}/run78-h200-ttft-colocated-vs-off/colocated.json",
        "78, co-located",
        "co-located: the defaults (4 nodes on the engine's host)",
    ),
    (
        f"{GPU_RESULTS}/run78-h200-ttft-colocated-vs-off/local-socket-off.json",
        "78, TCP",
        "TCP on loopback (`MEMKV_LOCAL_SOCKET=off`: the path to a node on another host)",
    ),
]
TOKENS = (8192, 32768, 65536)
COLD_RUN = f"{GPU_RESULTS}/run54-defaults-main-restart-notier.json"


def seconds(doc: dict, engine: str, phase: str, tokens: int) -> list[float]:
    """A phase's times; a promotion the nodes did not serve whole (`origin_ok` false: for example
    a prompt its engine never stored, its run skipped at the budget) is not a MemKV figure."""
    runs = doc["engines"].get(engine, {}).get("runs", [])
    return [
        r["seconds"] for r in runs if r["phase"] == phase and r["tokens"] == tokens and r.get("origin_ok") is not False
    ]


def pair(xs: list[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in xs) if xs else "-"


def gpu_ttft() -> list[str]:
    return paired_ttft(H200_RUNS, TOKENS)


def gpu_cold() -> list[str]:
    path = COLD_RUN
    d = load(path)
    rows = []
    for t in TOKENS:
        with_tier, without = seconds(d, "main", "recompute", t), seconds(d, "notier", "recompute_notier", t)
        rows.append([f"{t // 1024}k", pair(with_tier), pair(without), f"{med(with_tier) / med(without):.3f}"])
    what = (
        "A prompt's first (cold) run with the tier configured against the same engine with no secondary "
        "tier, same call, seconds"
    )
    host = d["meta"]["host"]
    return [
        f"{what}; run 54, {host['gpu'].split(',')[0]}, {host['date_utc']}, commit {COMMITS[path]}; source: `{path}`.",
        "",
        *table(
            ["prompt", "with the MemKV tier", "without a secondary tier", "with / without (medians)"], rows, right=1
        ),
    ]


H200_DATAPATH = [
    (f"{GPU_RESULTS}/run82-h200-datapath-fleet/dp8.json", ", 8 values per request"),
    (f"{GPU_RESULTS}/run82-h200-datapath-fleet/dp1.json", ", 1 value per request"),
]
H200_FLEET = f"{GPU_RESULTS}/run82-h200-datapath-fleet/fleet.json"
H200_HOST = "NVIDIA H200 host (16 vCPUs, `shmem_enabled=never`)"


def gpu_datapath() -> list[str]:
    docs = [(load(path), suffix) for path, suffix in H200_DATAPATH]
    d = docs[0][0]
    what = (
        f"`python3 bench/datapath.py --no-redis --reps {d['reps']} --threads {d['threads']} --blocks-per-op 8` "
        f"(and `1`): {d['value_bytes'] >> 20} MiB values, {d['nodes']} node, the systems interleaved in blocks"
    )
    rows = [row for doc, suffix in docs for row in datapath_rows(doc, suffix)]
    return [source_line([p for p, _ in H200_DATAPATH], what, H200_HOST), "", *table(DATAPATH_HEADER, rows)]


def gpu_fleet() -> list[str]:
    return fleet_table(H200_FLEET, H200_HOST)


H100_FLEET = f"{GPU_RESULTS}/run94-h100-fleet-loopback/fleet.json"


def gpu_h100_fleet() -> list[str]:
    return fleet_table(H100_FLEET, "NVIDIA H100 80GB HBM3 host (16 vCPUs), run 94")


def gpu_h100_datapath() -> list[str]:
    rows = []
    for label, path, _ in H100_DATAPATH:
        d = load(path)
        rows.append(
            [
                label,
                f"{med(d['block_median_ratios']['memkv-shm/raw-unix put']):.2f}",
                f"{med(d['block_median_ratios']['memkv-shm/raw-unix get']):.2f}",
                f"{med(d['block_median_ratios']['memkv/raw-unix put']):.2f}",
                f"{med(d['gbps']['memkv-shm put']):.1f} / {med(d['gbps']['memkv-shm get']):.1f}",
                f"{med(d['gbps']['raw-unix put']):.1f} / {med(d['gbps']['raw-unix get']):.1f}",
                f"{med(d['cpu_s_per_gb']['memkv-shm put']):.2f} / {med(d['cpu_s_per_gb']['memkv-shm get']):.2f}",
            ]
        )
    what = (
        "`python3 bench/datapath.py --no-redis --reps 3 [--src DIR]` on the H100 host (16 vCPUs, "
        "`shmem_enabled=never`), each build alternating with the previous design (in the archive) on one machine, "
        "the last run of each"
    )
    paths = [p for _, p, _ in H100_DATAPATH]
    return [
        source_line(paths, what, where="NVIDIA H100 80GB HBM3 host"),
        "",
        *table(
            [
                "shared memory design",
                "PUT vs raw-unix",
                "GET vs raw-unix",
                "socket PUT (shared memory off) vs raw-unix",
                "memkv-shm GB/s PUT / GET",
                "raw-unix GB/s PUT / GET",
                "memkv-shm CPU-s/GB PUT / GET",
            ],
            rows,
        ),
    ]


TABLES: dict[str, Callable[[], list[str]]] = {
    "vm-datapath": vm_datapath,
    "vm-batched": vm_batched,
    "vm-fleet": vm_fleet,
    "vm-memory": vm_memory,
    "vm-node-written": vm_node_written,
    "vm-fleet-node-written": vm_fleet_node_written,
    "vm-storm": vm_storm,
    "gpu-h100-ttft": gpu_h100_ttft,
    "gpu-h100-datapath": gpu_h100_datapath,
    "gpu-ttft": gpu_ttft,
    "gpu-cold": gpu_cold,
    "gpu-datapath": gpu_datapath,
    "gpu-fleet": gpu_fleet,
    "gpu-h100-fleet": gpu_h100_fleet,
}

BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def render(text: str) -> str:
    """The page with every table block regenerated; an unknown table name is an error."""

    def one(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in TABLES:
            raise SystemExit(f"docs/performance.md: no table named {name!r} (known: {', '.join(TABLES)})")
        return m.group(1) + "\n".join(TABLES[name]()) + "\n" + m.group(4)

    return BLOCK.sub(one, text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page differs from what the JSON gives")
    ap.add_argument("--page", type=Path, default=PAGE)
    args = ap.parse_args()
    text = args.page.read_text()
    new = render(text)
    if args.check:
        if new != text:
            sys.stdout.writelines(
                difflib.unified_diff(text.splitlines(True), new.splitlines(True), "page", "from JSON")
            )
            return 1
        return 0
    args.page.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
