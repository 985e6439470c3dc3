#!/usr/bin/env python3
"""TTFT of a revisited long prompt: direct mode vs the tier vs recompute, same nodes, same run.

Runs on a GPU host with vLLM installed (bench/gpu/stage.md) and this repository's `src/` on
PYTHONPATH. Starts `--nodes` MemKV nodes on loopback (bench/gpu/ttft.py's helpers), then one
engine process per (mode, role), so the restarted engine is a real new process:

  direct   OffloadingConnector + MemKVOffloadingSpec (spec_module_path memkv_vllm.direct):
           no CPU pool; a staging region of --staging-mb, host-registered (pinned) by the worker.
  tier     OffloadingConnector + TieringOffloadingSpec + the `memkv` tier: a CPU pool of
           --cpu-gib (pinned), then MemKV.
  none     no offload connector: each prompt's cold prefill twice (the baseline of direct mode's
           store cost: its recompute runs store every chunk)

  role main     per prompt: recompute (cold: first sight, stores to MemKV), then memkv (after
                llm.reset_prefix_cache(reset_connector=True): GPU cache and, for the tier, the
                CPU pool are emptied; direct mode has nothing to empty but its staging)
  role restart  a new engine process, same nodes: each prompt once (every hit from MemKV)

Process layout: vLLM's default, the engine core in its own process as `vllm serve` runs it;
the plugin is loaded there through its entry point (ttft.write_entry_point). The engine's
objects are out of reach there, so a run's MemKV bytes come from the nodes' own counters
(memkv_node_sent_bytes_total over the nodes' admin /v1/metrics: "chunks loaded" is the bytes
served / a chunk's bytes), a cold run ends when the nodes stopped receiving its stores (bounded),
direct mode's --timing records come from the engine core through a file (tier_probe.py's
DIRECT_TIMING_FILE), and pinned memory from the engine's child processes' VmLck. --inproc runs
the engine core in the benchmark's process instead (VLLM_ENABLE_V1_MULTIPROCESSING=0): the
managers' own counters, and the dry run below.

Each mode stores into its own key namespace (the two value layouts differ), so the tier's
revisit never reads direct-mode values or the reverse. Greedy output (max_tokens=1, top-5
logprobs) must agree across every run of a prompt, across modes too; a mismatch is reported
and makes the exit status 1. Pinned host memory per mode is recorded from the configuration
actually used (tier: cpu_bytes_to_use; direct: the staging region's size) and the engine
process's VmRSS / VmLck after the runs.

The model is ttft.py's Qwen2.5-32B-shaped dummy: 256 KiB of KV per token, 64-token chunks of
16 MiB (8k tokens = 2 GiB, 32k = 8 GiB). Direct mode runs with the key's default staging_mb
(1024; --staging-mb to change it) and --load-guarantee staged (the key's default before vLLM 0.34, "leased" from 0.34; a
HIT only for bytes already staged: reuse capped at the region's size unless --staging-mb is
raised, e.g. 9216 for 32k). --load-guarantee leased (a HIT
is a lease; workers stream every chunk through the region) must reuse the whole prompt. Each
revisit reports `chunks loaded / prompt chunks`; a revisit that did not reuse the whole prompt
is flagged unless staged mode's region is smaller than the prompt.

Dry run without a GPU (flow check; real nodes, vLLM's real connector on CPU tensors for direct
mode, bench/gpu/dryrun's stand-in for the tier; timings mean nothing):
  TTFT_FAKE_LLM=1 PYTHONPATH=bench/gpu/dryrun_direct:src:. .nox/conformance-0-25-0/bin/python \
    bench/gpu/direct.py --inproc --shape toy --tokens 1024,2048 --staging-mb 64 --cpu-gib 0.1 \
    --node-capacity 1GiB --out-dir /tmp/direct-dry

Usage (GPU host, repository root):
  eval "$(bash bench/gpu/stage.sh env)"; python3 bench/gpu/direct.py --out-dir $OUT
  ... --modes direct --tokens 8192                      # one mode, one size, defaults
  ... --modes direct --load-guarantee staged --staging-mb 9216   # the staged guarantee
Output: a table on stdout and <out-dir>/direct.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ttft  # noqa: E402  (helpers only: nodes, prompts, shapes, metrics; ttft.py is not modified)

BLOCK_TOKENS = ttft.BLOCK_TOKENS


def log(msg: str) -> None:
    print(f"[direct {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def kv_transfer_config(spec: dict) -> dict | None:
    if spec["mode"] == "none":  # no offload connector: the cold-prefill baseline (issue 44 item 3)
        return None
    if spec["mode"] == "direct":
        extra = {
            "spec_name": "MemKVOffloadingSpec",
            "spec_module_path": "memkv_vllm.direct",
            "block_size": BLOCK_TOKENS,
            "memkv": {"staging_mb": spec["staging_mb"], "prefix": "direct/", "load_guarantee": spec["load_guarantee"]},
        }
        if spec.get("copy_scratch_mb") is not None:
            extra["memkv"]["copy_scratch_mb"] = spec["copy_scratch_mb"]
        if spec.get("copy_method") is not None:
            extra["memkv"]["copy_method"] = spec["copy_method"]
        extra["memkv"].update(spec.get("memkv_keys") or {})
    else:
        extra = {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": int(spec["cpu_gib"] * 2**30),
            "block_size": BLOCK_TOKENS,
            "secondary_tiers": [{"type": "memkv", "prefix": "tier/"}],
        }
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def proc_status(pid: int | str = "self") -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmLck", "VmPin")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    return out


def engine_status() -> dict:
    """VmRSS / VmLck / VmPin of this process and its children (the engine core), summed."""
    pids: list[int | str] = ["self"]
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            pids.append(int(stat.split("/")[2]))
    out: dict = {}
    for pid in pids:
        try:
            for k, v in proc_status(pid).items():
                out[k] = out.get(k, 0) + v
        except OSError:
            pass
    return out


def memkv_object(llm, mode: str):
    """The direct manager or the memkv tier of an in-process engine (stats.totals, layout); None
    without a connector."""
    if mode == "none":
        return None
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    mgr = conn.connector_scheduler.manager
    return mgr if mode == "direct" else mgr.secondary_tiers[0]


def totals(obj) -> dict:
    if obj is None:
        return {}
    with obj.stats._lock:
        return {f"{n}{{{','.join(labels)}}}": float(v) for (n, labels), v in obj.stats.totals.items()}


def ttft_chunk_bytes(spec: dict) -> int:
    """Bytes of one 64-token chunk over all ranks (the tier: one pool row)."""
    shape = ttft.SHAPES[spec["shape"]]
    head = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head * 2 * BLOCK_TOKENS


class StageLog(logging.Handler):
    """Direct mode's timing records (memkv_vllm.direct.timing, with --timing), summed per run:
    lookup_s (first lookup -> load prepared), load_s (the load jobs' wall time), fetch_s (network
    thread-seconds over the fetch threads: the mean thread's busy time), copy_s (staging -> GPU),
    overlap_s (fetch_s + copy_s - load_s: how long both ran at once) and store_s (store jobs)."""

    def __init__(self, path: str | None = None) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, tuple]] = []
        self.path = path  # the engine core's records (tier_probe.JsonLinesHandler), when out of process
        self._read = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((str(record.msg), tuple(record.args or ())))

    def catch_up(self) -> list[str]:
        """The engine core's records written since the last call, added; returned as text."""
        if not self.path or not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            f.seek(self._read)
            data = f.read()
        data = data[: data.rfind(b"\n") + 1]  # whole lines only
        self._read += len(data)
        text = []
        for line in data.decode().splitlines():
            msg, args = json.loads(line)
            self.records.append((msg, tuple(args)))
            try:
                text.append(msg % tuple(args))
            except (TypeError, ValueError):
                text.append(f"{msg} {args}")
        return text

    def summary(self, first: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for msg, a in self.records[first:]:
            if msg.startswith("request ") and "prepared" in msg:
                out["lookup_s"] = out.get("lookup_s", 0.0) + a[2]
            elif msg.startswith("rank ") and len(a) >= 12:
                # (rank, "load"|"store", job, chunks, MiB, took, GB/s, first, net_s, threads, copy_s, slot_wait_s)
                if a[1] == "store":
                    out["store_s"] = out.get("store_s", 0.0) + a[5]
                    continue
                fetch = a[8] / max(a[9], 1)
                for k, v in (
                    ("load_s", a[5]),
                    ("fetch_s", fetch),
                    ("copy_s", a[10]),
                    ("overlap_s", fetch + a[10] - a[5]),
                ):
                    out[k] = out.get(k, 0.0) + v
        return out


def engine_child(spec: dict) -> int:
    result: dict = {"mode": spec["mode"], "role": spec["role"], "spec": spec, "runs": [], "errors": []}

    def save():
        with open(spec["out"] + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(spec["out"] + ".tmp", spec["out"])

    inproc = spec["inproc"]
    stage_log = StageLog(None if inproc else spec.get("timing_file"))
    if spec.get("timing") and inproc:  # direct mode's per-job stage times (DEBUG, its own logger)
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[timing %(asctime)s] %(message)s"))
        timing = logging.getLogger("memkv_vllm.direct.timing")
        timing.addHandler(handler)
        timing.addHandler(stage_log)
        timing.setLevel(logging.DEBUG)
    import memkv_vllm

    memkv_vllm.register()  # what the vllm.general_plugins entry point does
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    shape = ttft.SHAPES[spec["shape"]]
    model_dir = ttft.write_model_dir(spec["shape"], f"/tmp/ttft_model_{spec['shape']}")  # the same dummy as ttft.py
    result["versions"] = {"vllm": vllm.__version__}
    kw = dict(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        kv_transfer_config=kv_transfer_config(spec),
        gpu_memory_utilization=spec["gpu_util"],
        max_model_len=max(spec["tokens"]) + 64,
        enable_prefix_caching=True,
        enforce_eager=spec["eager"],
        seed=0,
        disable_log_stats=False,
    )
    if spec["tp"] > 1:
        kw["tensor_parallel_size"] = spec["tp"]
    t = time.perf_counter()
    llm = LLM(**kw)
    result["engine_init_s"] = time.perf_counter() - t
    obj = memkv_object(llm, spec["mode"]) if inproc else None
    if spec["mode"] == "direct" and not inproc:
        result["pinned_bytes"] = spec["staging_mb"] * spec["tp"] << 20
        result["chunk_bytes"] = ttft_chunk_bytes(spec)
    elif spec["mode"] == "direct":
        result["pinned_bytes"] = obj.layout.region_bytes
        result["staging"] = {"slots": obj.layout.num_slots, "slot_bytes": obj.layout.slot_bytes}
        result["chunk_bytes"] = obj.layout.value_bytes * obj.layout.world_size
    elif spec["mode"] == "tier":
        result["pinned_bytes"] = int(spec["cpu_gib"] * 2**30)
        # bench/gpu/dryrun's stand-in tier moves rows of its own size (ttft.py reads it the same way)
        result["chunk_bytes"] = int(getattr(llm, "ttft_block_bytes", 0) or ttft_chunk_bytes(spec))
    else:
        result["pinned_bytes"] = 0
    log(
        f"[{spec['mode']}/{spec['role']}] engine up in {result['engine_init_s']:.1f} s, "
        f"pinned host memory {result['pinned_bytes'] / 2**30:.2f} GiB"
    )
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, logprobs=5)

    admin = spec["admin_ports"]

    def settle(phase: str, tokens: int, before_nodes: dict) -> dict:
        """Until the run's stores are done (in process: the connector's pending work; out of
        process: the nodes stopped receiving, bounded); the nodes' counters since before it."""
        if inproc:
            settle_in_process()
        elif spec["mode"] != "none":
            prompt_bytes = tokens // BLOCK_TOKENS * ttft_chunk_bytes(spec)
            if phase == "recompute":
                ttft.wait_nodes(admin, before_nodes, "received", prompt_bytes, 120.0, quiet_s=2.0)
            else:
                ttft.wait_nodes(admin, before_nodes, "sent", prompt_bytes, 10.0, quiet_s=0.5)
        return ttft.node_delta(ttft.node_counters(admin), before_nodes) if spec["mode"] != "none" else {}

    def settle_in_process() -> None:
        conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
        if conn is None:
            return
        deadline = time.monotonic() + 120
        while conn.has_pending_push_work() and time.monotonic() < deadline:
            llm.llm_engine.step()
        if conn.has_pending_push_work():
            result["errors"].append("settle: still pending after 120 s")

    def run(phase: str, tokens: int, ids: list[int]) -> None:
        before = totals(obj)
        before_nodes = ttft.node_counters(admin) if spec["mode"] != "none" else {}
        stage_log.catch_up()
        first_record = len(stage_log.records)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        comp = out.outputs[0]
        lp = comp.logprobs[0] if comp.logprobs else {}
        rec = {
            "phase": phase,
            "tokens": tokens,
            "seconds": seconds,
            "token_ids": list(comp.token_ids),
            "top5": [[int(k), float(v.logprob)] for k, v in sorted(lp.items(), key=lambda kv: -kv[1].logprob)],
            "counters": ttft.diff(totals(obj), before),
        }
        nodes = settle(phase, tokens, before_nodes)
        rec["counters_after_settle"] = ttft.diff(totals(obj), before)
        rec["node_sent_bytes"] = nodes.get("sent", 0.0)
        rec["node_received_bytes"] = nodes.get("received", 0.0)
        caught = stage_log.catch_up()
        for line in caught if spec.get("timing") else []:
            print(f"[timing] {line}", flush=True)
        rec["stages"] = stage_log.summary(first_record)
        if inproc:
            loaded = sum(v for k, v in rec["counters_after_settle"].items() if "load_bytes" in k)
        else:  # what the nodes served (the recompute's lookups are a few bytes)
            loaded = rec["node_sent_bytes"] if phase != "recompute" else 0.0
        rec["memkv_load_bytes"] = loaded
        chunk_bytes = result.get("chunk_bytes") or ttft_chunk_bytes(spec)
        rec["chunks_loaded"] = int(loaded // chunk_bytes)
        rec["prompt_chunks"] = tokens // BLOCK_TOKENS
        log(
            f"[{spec['mode']}/{spec['role']}] {phase:<9} {tokens:>6} tok: {seconds:.3f} s  tok={rec['token_ids']} "
            f"memkv_load={loaded / 2**30:.2f} GiB chunks={rec['chunks_loaded']}/{rec['prompt_chunks']}"
            + "".join(f" {k}={v:.3f}" for k, v in rec["stages"].items())
        )
        result["runs"].append(rec)
        save()

    try:
        for tokens in spec["tokens"]:
            ids = ttft.prompt_ids(tokens, ttft.prompt_seed(tokens, 0), shape["vocab_size"])
            if spec["mode"] == "none":  # cold prefill twice, no connector
                run("recompute", tokens, ids)
                llm.reset_prefix_cache()
                run("recompute", tokens, ids)
            elif spec["role"] == "main":
                run("recompute", tokens, ids)
                llm.reset_prefix_cache(reset_connector=True)
                run("memkv", tokens, ids)
                if spec["mode"] == "tier":  # the CPU pool holds the prompt now: only the GPU cache is emptied
                    llm.reset_prefix_cache()
                    run("pool", tokens, ids)
            else:
                run("restart", tokens, ids)
        result["proc_status"] = proc_status() if inproc else engine_status()
    except Exception as exc:  # recorded, the parent reports it
        import traceback

        result["errors"].append(traceback.format_exc())
        log(f"[{spec['mode']}/{spec['role']}] failed: {exc!r}")
    save()
    return 0 if not result["errors"] else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-child")
    ap.add_argument("--out-dir", default="bench/gpu/results/direct")
    ap.add_argument("--modes", default="direct,tier", help="of direct, tier, none (no offload connector)")
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--staging-mb", type=int, help="direct mode's staging_mb (default: the key's default)")
    ap.add_argument(
        "--copy-scratch-mb", type=int, default=None, help="direct mode's copy_scratch_mb (default: the key's)"
    )
    ap.add_argument(
        "--copy-method",
        choices=("scratch", "pieces"),
        default=None,
        help="direct mode's copy_method (default: the key's)",
    )
    ap.add_argument(
        "--load-guarantee",
        default="staged",
        choices=("leased", "staged"),
        help="direct mode's load_guarantee (default: staged; the key's own default is leased on vLLM 0.34+)",
    )
    ap.add_argument(
        "--memkv",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="another key of direct mode's memkv extra config, e.g. n_read_threads=16 (repeatable)",
    )
    ap.add_argument("--cpu-gib", type=float, default=24.0)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--node-capacity", default="24GiB")
    ap.add_argument("--shape", default="32b", choices=sorted(ttft.SHAPES))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--gpu-util", type=float, default=0.85)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument(
        "--timing",
        action="store_true",
        help="print direct mode's per-job stage times (lookups, network, copies, slot waits)",
    )
    ap.add_argument(
        "--inproc",
        action="store_true",
        help="the engine core in the benchmark's process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the managers' "
        "counters are read directly. Default: vLLM's own layout, the engine core in its own process",
    )
    ap.add_argument("--child-timeout-s", type=float, default=1500)
    ap.add_argument(
        "--state-dir",
        default="/tmp/direct-state",
        help="the nodes' logs and state (outside --out-dir: what a GPU call brings back stays small)",
    )
    args = ap.parse_args()
    memkv_keys = {}
    for item in args.memkv:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--memkv {item!r}: expected KEY=JSON")
        try:
            memkv_keys[key] = json.loads(value)
        except json.JSONDecodeError as exc:
            ap.error(f"--memkv {item!r}: the value after '=' is not JSON ({exc}); e.g. n_read_threads=16")
    if args.engine_child:
        with open(args.engine_child) as f:
            return engine_child(json.load(f))
    from memkv_vllm.direct.config import DEFAULT_STAGING_MB  # needs vLLM: imported here, not at the top

    staging_mb = DEFAULT_STAGING_MB if args.staging_mb is None else args.staging_mb
    os.makedirs(args.out_dir, exist_ok=True)
    state = ttft.start_nodes(args.nodes, args.node_capacity, "64MiB", os.path.join(args.state_dir, "nodes"), [])
    env = {
        **os.environ,
        "MEMKV_SERVERS": ",".join(n["address"] for n in state["nodes"]),
        "MEMKV_AUTH_KEY": state["key"],
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if args.inproc else "1",
        "PYTHONHASHSEED": "0",  # block hashes equal across engine processes (restart reuse)
    }
    if not args.inproc:  # the plugin (and the timing sink) loaded in the engine core through the entry point
        ep_dir = ttft.write_entry_point(os.path.join(args.state_dir, "entry-point"))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ep_dir, HERE, os.environ.get("PYTHONPATH")]))
    tokens = [int(t) for t in args.tokens.split(",")]
    engines = []
    try:
        for mode in args.modes.split(","):
            for role in ("main",) if mode == "none" else ("main", "restart"):
                spec = {
                    "mode": mode,
                    "role": role,
                    "tokens": tokens,
                    "staging_mb": staging_mb,
                    "load_guarantee": args.load_guarantee,
                    "copy_scratch_mb": args.copy_scratch_mb,
                    "copy_method": args.copy_method,
                    "memkv_keys": memkv_keys,
                    "cpu_gib": args.cpu_gib,
                    "shape": args.shape,
                    "tp": args.tp,
                    "gpu_util": args.gpu_util,
                    "eager": args.eager,
                    "timing": args.timing,
                    "inproc": args.inproc,
                    "admin_ports": [n["admin"] for n in state["nodes"]],
                    "timing_file": os.path.join(args.state_dir, f"timing-{mode}-{role}.jsonl"),
                    "out": os.path.join(args.out_dir, f"{mode}-{role}.json"),
                }
                if os.path.exists(spec["timing_file"]):
                    os.unlink(spec["timing_file"])
                child_env = dict(env)
                if args.timing and not args.inproc:
                    child_env["DIRECT_TIMING_FILE"] = spec["timing_file"]
                with open(spec["out"] + ".spec", "w") as f:
                    json.dump(spec, f)
                t = time.perf_counter()
                before = set(glob.glob("/dev/shm/memkv_direct_*.staging"))
                try:
                    rc = subprocess.run(
                        [sys.executable, os.path.abspath(__file__), "--engine-child", spec["out"] + ".spec"],
                        env=child_env,
                        timeout=args.child_timeout_s,
                    ).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
                log(f"{mode}/{role}: exit {rc} after {time.perf_counter() - t:.0f} s")
                for path in set(glob.glob("/dev/shm/memkv_direct_*.staging")) - before:  # a killed child's
                    os.unlink(path)
                    log(f"removed leftover {path}")
                try:
                    with open(spec["out"]) as f:
                        engines.append(json.load(f))
                except Exception:
                    engines.append({"mode": mode, "role": role, "runs": [], "errors": [f"no result (exit {rc})"]})
    finally:
        ttft.stop_nodes(state)

    # Table and output agreement.
    bad = []
    outputs: dict[int, set] = {}
    print(
        f"\n{'mode':<7} {'role':<8} {'tokens':>6} {'phase':<9} {'TTFT s':>8} {'MemKV GiB':>9} {'chunks':>11} "
        f"{'pinned GiB':>10}  stages s (--timing: lookup, load job, fetch, copy, overlap; store jobs)"
    )
    for e in engines:
        for r in e.get("runs", []):
            loaded = r["memkv_load_bytes"]
            chunks = f"{r.get('chunks_loaded', '?')}/{r.get('prompt_chunks', '?')}"
            print(
                f"{e['mode']:<7} {e['role']:<8} {r['tokens']:>6} {r['phase']:<9} {r['seconds']:>8.3f} "
                f"{loaded / 2**30:>9.3f} {chunks:>11} {e.get('pinned_bytes', 0) / 2**30:>10.2f}  "
                + " ".join(f"{k[:-2]}={v:.3f}" for k, v in r.get("stages", {}).items())
            )
            outputs.setdefault(r["tokens"], set()).add(tuple(r["token_ids"]))
            # A chunk-aligned prompt may recompute its last chunk (vLLM computes the last token itself).
            # Staged direct mode with a region smaller than the prompt reuses what the region holds (expected).
            sp = e.get("spec", {})
            capped = (
                e["mode"] == "direct"
                and sp.get("load_guarantee") == "staged"
                and r.get("prompt_chunks", 0) * e.get("chunk_bytes", 0) > sp.get("staging_mb", 0) * 2**20
            )
            if (
                r["phase"] not in ("recompute", "pool")
                and not capped
                and r.get("chunks_loaded", 0) < r.get("prompt_chunks", 0) - 1
            ):
                bad.append(
                    f"{e['mode']}/{e['role']} {r['tokens']} tokens: reused {chunks} chunks, not the whole prompt"
                )
        bad += [f"{e['mode']}/{e['role']}: {err[:300]}" for err in e.get("errors", [])]
    for tok, outs in outputs.items():
        if len(outs) != 1:
            bad.append(f"{tok} tokens: greedy outputs differ across runs: {sorted(outs)}")
    with open(os.path.join(args.out_dir, "direct.json"), "w") as f:
        json.dump({"host": ttft.host_info(), "args": vars(args), "engines": engines, "problems": bad}, f, indent=1)
    for p in bad:
        log(f"PROBLEM: {p}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
