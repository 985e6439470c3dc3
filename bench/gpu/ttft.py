#!/usr/bin/env python3
"""Time to first token of a revisited long prompt on a real vLLM engine, promoted from MemKV.

Runs on a GPU host with vLLM installed (0.25.0 on the H200 host: bench/gpu/stage.md) and this
repository's `src/` on PYTHONPATH. It starts `--nodes` MemKV nodes on loopback itself, then
runs each engine in its own child process (so the "restart" engine is a real new process):

  main     one engine with TieringOffloadingSpec + the `memkv` tier. Per prompt:
             recompute  first sight of the prompt (cold; stores cascade GPU -> CPU pool -> MemKV)
             cpu_hit    after llm.reset_prefix_cache()                      (GPU cache emptied)
             memkv      after llm.reset_prefix_cache(reset_connector=True)  (CPU pool emptied too;
                        the secondary tiers are not reset by vLLM: blocks come back from MemKV)
           optionally first (--sweep, needs --inproc) a sweep of tier settings on its own 32k
           prompt; the best setting is then used for every later measurement and the restart.
  restart  a second engine process, same MemKV nodes, same settings: each prompt once (its
           GPU cache and CPU pool start empty, so every hit comes from MemKV).
  fs       a third engine process with vLLM's own `fs` tier instead of memkv (O_DIRECT files
           under --fs-root), same prompts, same three phases: recompute, cpu_hit, fs.
  notier   the same engine shape with TieringOffloadingSpec and no secondary tier (the CPU
           pool alone): cold runs only, to compare a cold run's TTFT with and without the tier.
  raw      no engine: each prompt's KV bytes fetched over loopback TCP from --nodes raw server
           processes (bench/datapath.py's raw design) by the tier's read threads, --reps times:
           the breakdown prints the MemKV -> pool stage's GB/s against it ("x raw TCP").

Defaults are what a user gets: the tier config README.md shows, {"type": "memkv",
"n_read_threads": 8, "n_write_threads": 8} (no tuned keys; --tier-json or the tuning flags add
them, recorded), and vLLM's own process layout, the engine core in its own process as `vllm
serve` runs it. The plugin is loaded there through its `vllm.general_plugins` entry point (a
dist-info written to the state dir and put on PYTHONPATH, as `pip install memkv` leaves it).
The tier object is out of reach in that layout, so origin is proven from the nodes' own
counters: memkv_node_sent_bytes_total (and received), summed over the nodes' admin
/v1/metrics, read before and after every timed run; every promotion run (memkv, restart_memkv)
must have been served at least the prompt's KV bytes (full 64-token blocks x 16 MiB), or it is
an ORIGIN error (exit status 1), like an output mismatch. After each cold run the script
waits (bounded, --store-wait-s) until the nodes received the prompt's blocks, since the engine
core finishes the cascade on its own time.

--inproc runs the engine core in the engine's process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the
tier object is reachable: its counters (`tier.stats.totals`, the values behind
vllm:kv_offload_memkv_*) are recorded and --sweep can swap settings on the live tier. The stage
breakdown of each promotion (tier_probe.py) is recorded in both layouts: in the default one vLLM
loads the probe into the engine core as a general plugin and it writes to TTFT_PROBE_FILE. vLLM's Prometheus metrics (llm.get_metrics())
are recorded in both layouts. Greedy output (max_tokens=1, top-5 logprobs) must be identical in
every phase of a prompt, across engines too; a mismatch is reported and makes the exit status 1.

The model is a Qwen2.5-32B-shaped dummy (64 layers, hidden 5120, 40 heads, 8 KV heads,
intermediate 27648; load_format="dummy", no tokenizer, token-id prompts): 256 KiB of KV per
token, 16 MiB per 64-token offload block.

Usage (on the GPU host, from the repository root):
  eval "$(bash bench/gpu/stage.sh env)"; python3 bench/gpu/ttft.py --out-dir $OUT
  ... --phases fs --inproc              # only the fs engine
  ... --phases main,restart --keep-nodes   # leave the nodes running for a later invocation
  ... --phases notier --reps 3          # cold runs without a secondary tier
  ... --inproc --store-backlog-mb 12288 --read-threads 16 --sweep 16x2,16x8   # tuned, with breakdown
Output: a table on stdout and <out-dir>/ttft-<phases>.json. bench/gpu/report.py turns one or
more of those JSON files into the docs table and plot.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.request

from tier_probe import ENV_FILE as PROBE_ENV
from tier_probe import ENV_PHASES as PROBE_PHASES_ENV
from tier_probe import FileProbe, TierProbe, stages

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BLOCK_TOKENS = 64
READY_RE = re.compile(r"memkv node listening on (\S+):(\d+) \(admin (\S+):(\d+)\)")

SHAPES = {
    # Qwen2.5-32B dimensions (vocab included); max_position_embeddings raised for 64k prompts.
    "32b": dict(
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
    ),
    # A toy for smoke tests of this script (8 layers: prefill too cheap to show anything).
    "toy": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
}


def log(msg: str) -> None:
    print(f"[ttft {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# =================================================================================================
# MemKV nodes (detached processes, so a later invocation can reuse them with --reuse-nodes)
# =================================================================================================


def start_nodes(n: int, capacity: str, max_value: str, state_dir: str, extra: list[str]) -> dict:
    os.makedirs(state_dir, exist_ok=True)
    key = os.urandom(32).hex()
    env = {**os.environ, "MEMKV_AUTH_KEY": key, "PYTHONUNBUFFERED": "1"}
    procs = []
    for i in range(n):
        path = os.path.join(state_dir, f"node{i}.log")
        with open(path, "w") as f:  # the child keeps its own copy of the descriptor
            cmd = [
                sys.executable,
                "-m",
                "memkv",
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-port",
                "0",
                "--capacity",
                capacity,
                "--max-value-size",
                max_value,
                "--node-id",
                f"bench{i}",
                *extra,
            ]
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        procs.append((p, path))
    nodes = []
    deadline = time.monotonic() + 60
    for p, path in procs:
        while True:
            with open(path) as lf:
                text = lf.read()
            m = READY_RE.search(text)
            if m:
                nodes.append(
                    {"pid": p.pid, "address": f"{m.group(1)}:{m.group(2)}", "admin": int(m.group(4)), "log": path}
                )
                break
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"memkv node did not start:\n{text[-3000:]}")
            time.sleep(0.05)
    state = {"key": key, "nodes": nodes, "capacity": capacity, "max_value": max_value}
    with open(os.path.join(state_dir, "nodes.json"), "w") as f:
        json.dump(state, f)
    log(f"started {n} memkv nodes: {[x['address'] for x in nodes]} (capacity {capacity} each)")
    return state


def stop_nodes(state: dict) -> None:
    for node in state["nodes"]:
        try:
            os.kill(node["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    for node in state["nodes"]:
        while time.monotonic() < deadline:
            try:
                os.kill(node["pid"], 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            try:
                os.kill(node["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def node_status(state: dict) -> list:
    out = []
    try:
        from memkv.cli.admin import fetch_status
    except Exception as exc:  # pragma: no cover - informational only
        return [f"fetch_status unavailable: {exc}"]
    for node in state["nodes"]:
        try:
            out.append(fetch_status("127.0.0.1", node["admin"]))
        except Exception as exc:
            out.append({"address": node["address"], "error": str(exc)})
    return out


# The tier configuration README.md shows (and users copy): no tuned keys. The default of every
# engine here; --tier-json / the tuning flags replace or extend it explicitly.
README_TIER = {"type": "memkv", "n_read_threads": 8, "n_write_threads": 8}

_PROM_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prom(text: str, keep=lambda name: True) -> dict:
    """Prometheus text exposition -> {"name{labels}": value} for the series `keep` accepts."""
    out = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _PROM_LINE.match(line)
        if not m or not keep(m.group(1)):
            continue
        try:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        except ValueError:
            pass
    return out


NODE_SERIES = (
    "memkv_node_sent_bytes_total",
    "memkv_node_received_bytes_total",
    "memkv_node_keys_total",
    "memkv_node_stored_bytes",
    "memkv_node_values",
    "memkv_node_requests_total",
    "process_cpu_seconds_total",
)


def node_counters(admin_ports: list, host: str = "127.0.0.1", timeout_s: float = 3.0) -> dict:
    """The nodes' own counters from each admin /v1/metrics, summed: sent (GET value bytes),
    received (PUT value bytes), get_ok / get_miss keys, stored bytes. `errors` lists the nodes
    that did not answer (then the sums are incomplete and an origin check must fail)."""
    tot = {
        "sent": 0.0,
        "received": 0.0,
        "get_ok": 0.0,
        "get_miss": 0.0,
        "stored": 0.0,
        "values": 0.0,
        "get_requests": 0.0,
        "rdma_get_requests": 0.0,
        "cpu_s": 0.0,
        "per_node_sent": [],
        "errors": [],
    }
    for port in admin_ports:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/v1/metrics", timeout=timeout_s) as r:
                v = parse_prom(r.read().decode(), lambda n: n in NODE_SERIES)
        except Exception as exc:
            tot["errors"].append(f"admin port {port}: {exc!r}")
            tot["per_node_sent"].append(None)
            continue
        sent = v.get("memkv_node_sent_bytes_total", 0.0)
        tot["sent"] += sent
        tot["per_node_sent"].append(sent)
        tot["received"] += v.get("memkv_node_received_bytes_total", 0.0)
        tot["get_ok"] += v.get('memkv_node_keys_total{op="get",result="ok"}', 0.0)
        tot["get_miss"] += v.get('memkv_node_keys_total{op="get",result="miss"}', 0.0)
        tot["stored"] += v.get("memkv_node_stored_bytes", 0.0)
        tot["values"] += v.get("memkv_node_values", 0.0)
        tot["get_requests"] += v.get('memkv_node_requests_total{op="get"}', 0.0)
        tot["rdma_get_requests"] += v.get('memkv_node_requests_total{op="rdma_get"}', 0.0)  # which transport served
        tot["cpu_s"] += v.get("process_cpu_seconds_total", 0.0)  # the nodes' own CPU (user + system)
    return tot


def node_delta(after: dict, before: dict) -> dict:
    d = {
        k: after[k] - before.get(k, 0.0)
        for k in ("sent", "received", "get_ok", "get_miss", "get_requests", "rdma_get_requests", "cpu_s")
    }
    d["stored_after"] = after["stored"]
    d["per_node_sent"] = [
        None if a is None or b is None else a - b for a, b in zip(after["per_node_sent"], before["per_node_sent"])
    ]
    d["errors"] = before["errors"] + after["errors"]
    return d


def wait_nodes(
    admin_ports: list, before: dict, key: str, expected: float, timeout_s: float, quiet_s: float = 3.0
) -> tuple[dict, float, bool]:
    """Poll the nodes until counter `key` grew by >= expected since `before`, or stopped growing
    for quiet_s, or timeout_s passed. Returns (delta, seconds, reached)."""
    t0 = time.monotonic()
    last, last_change = None, t0
    while True:
        d = node_delta(node_counters(admin_ports), before)
        now = time.monotonic()
        if d[key] >= expected:
            return d, now - t0, True
        if last is None or d[key] != last:
            last, last_change = d[key], now
        if now - last_change >= quiet_s or now - t0 >= timeout_s:
            return d, now - t0, False
        time.sleep(0.05)


def write_entry_point(root: str) -> str:
    """A `memkv` distribution's metadata with the `vllm.general_plugins` entry point (what
    `pip install memkv` leaves in site-packages), under `root`: on PYTHONPATH it makes vLLM load
    the plugin in every process it starts (API server, engine core, workers), as for a user.
    The packages themselves come from src/ on PYTHONPATH. Returns root."""
    version = "0.1.0"
    try:
        with open(os.path.join(REPO, "pyproject.toml")) as f:
            m = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M)
            version = m.group(1) if m else version
    except OSError:
        pass
    d = os.path.join(root, f"memkv-{version}.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: memkv\nVersion: {version}\n")
    with open(os.path.join(d, "entry_points.txt"), "w") as f:
        # ttft_probe: this benchmark's stage timestamps in the engine core (tier_probe.py; a no-op
        # unless TTFT_PROBE_FILE is set). Not part of what `pip install memkv` installs.
        f.write(
            "[vllm.general_plugins]\nmemkv_tier = memkv_vllm:register\nttft_probe = tier_probe:install_plugin\n\n"
            "[console_scripts]\nmemkv = memkv.cli:main\n"
        )
    return root


def write_model_dir(shape_name: str, model_dir: str) -> str:
    """A model directory holding only config.json (Qwen2 architecture, `shape_name` dims):
    with load_format=dummy and no tokenizer nothing is downloaded."""
    os.makedirs(model_dir, exist_ok=True)
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **SHAPES[shape_name],
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "max_window_layers": 64,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return model_dir


def kv_bytes_per_token(shape_name: str) -> int:
    shape = SHAPES[shape_name]
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * 128 * 2  # K+V, head_dim 128, bf16


# =================================================================================================
# Engine child: one vLLM engine, in-process, measuring a list of runs
# =================================================================================================


def prompt_ids(length: int, seed: int, vocab: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, vocab) for _ in range(length)]


def prompt_seed(length: int, rep: int) -> int:
    return 1_000_003 * length + rep  # the same prompt in every engine process


def sweep_seed(length: int) -> int:
    return 7_777_777 + length


def find_manager(llm):
    """The TieringOffloadingManager of an in-process engine (vLLM 0.25 attribute chain, with a
    bounded search as fallback for other releases)."""
    try:
        ec = llm.llm_engine.engine_core.engine_core
        sched = ec.scheduler
        conn = sched.connector
        mgr = conn.connector_scheduler.manager
        if hasattr(mgr, "secondary_tiers"):
            return mgr, sched, conn
    except Exception:
        pass
    seen, frontier = set(), [llm]
    sched = conn = None
    for _ in range(8):
        nxt = []
        for obj in frontier:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if hasattr(obj, "secondary_tiers") and hasattr(obj, "primary_tier"):
                return obj, sched, conn
            if type(obj).__name__ == "Scheduler" and hasattr(obj, "connector"):
                sched = obj
                conn = obj.connector
            d = getattr(obj, "__dict__", None)
            if d:
                nxt.extend(v for v in d.values() if hasattr(v, "__dict__") and not isinstance(v, type))
        frontier = nxt
    raise RuntimeError("cannot find the TieringOffloadingManager (is VLLM_ENABLE_V1_MULTIPROCESSING=0 set?)")


def metrics_snapshot(llm) -> dict:
    """{name{labels}: value} of vLLM's kv-offload Prometheus series (counters, histogram sums/counts)."""
    out = {}
    try:
        for m in llm.get_metrics():
            if "kv_offload" not in m.name and "prefix_cache" not in m.name:
                continue
            lab = ",".join(f"{k}={v}" for k, v in sorted((m.labels or {}).items()) if k not in ("engine", "model_name"))
            key = f"{m.name}{{{lab}}}"
            if hasattr(m, "value"):
                out[key] = float(m.value)
            elif hasattr(m, "count"):
                out[key + ":count"] = float(m.count)
                out[key + ":sum"] = float(m.sum)
    except Exception as exc:
        out["_error"] = repr(exc)
    return out


def diff(after: dict, before: dict) -> dict:
    d = {}
    for k, v in after.items():
        if isinstance(v, (int, float)):
            dv = v - before.get(k, 0.0)
            if dv:
                d[k] = dv
    return d


def tier_totals(tier) -> dict:
    try:
        with tier.stats._lock:
            return {f"{n}{{{','.join(labels)}}}": float(v) for (n, labels), v in tier.stats.totals.items()}
    except Exception:
        return {}


def engine_child(spec: dict) -> int:
    out_path = spec["out"]
    result: dict = {
        "role": spec["role"],
        "spec": {k: v for k, v in spec.items() if k != "out"},
        "runs": [],
        "errors": [],
    }

    def save():
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, out_path)

    deadline = spec.get("deadline") or 1e18
    shape = SHAPES[spec["shape"]]
    vocab = shape["vocab_size"]
    max_tokens_prompt = max(spec["tokens"] + ([spec["sweep_tokens"]] if spec.get("sweep") else []))
    model_dir = write_model_dir(spec["shape"], f"/tmp/ttft_model_{spec['shape']}")
    inproc = bool(spec.get("inproc"))
    admin_ports = spec.get("admin_ports") or []
    result["process_layout"] = "in-process engine core" if inproc else "engine core in its own process"

    tier_kind = spec["tier"]["type"] if spec.get("tier") else "none"
    if tier_kind == "memkv":
        import memkv_vllm  # registers tier type `memkv` (what the vllm.general_plugins entry point does)

        memkv_vllm.register()
        try:
            from importlib.metadata import entry_points

            result["entry_point_visible"] = any(
                e.name == "memkv_tier" for e in entry_points(group="vllm.general_plugins")
            )
        except Exception:
            result["entry_point_visible"] = None
    if tier_kind == "fs":
        shutil.rmtree(spec["tier"]["root_dir"], ignore_errors=True)
        os.makedirs(spec["tier"]["root_dir"], exist_ok=True)

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version()}

    ktc = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": int(spec["cpu_gib"] * 2**30),
            "block_size": BLOCK_TOKENS,
            "secondary_tiers": [spec["tier"]] if spec.get("tier") else [],
        },
    }
    kw = dict(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        kv_transfer_config=ktc,
        gpu_memory_utilization=spec["gpu_util"],
        max_model_len=max_tokens_prompt + 64,
        enable_prefix_caching=True,
        enforce_eager=spec["eager"],
        seed=0,
        disable_log_stats=False,
    )
    if spec.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    if spec.get("tp", 1) > 1:
        # Workers become processes; the scheduler (and the tier) stay in this process. One CPU-pool
        # row, and so one MemKV value, holds a block's slices of every rank.
        kw["tensor_parallel_size"] = spec["tp"]
    t = time.perf_counter()
    llm = LLM(**kw)
    result["engine_init_s"] = time.perf_counter() - t
    try:  # after the engine: CUDA initialised earlier would make vLLM spawn its engine core instead of forking
        result["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        result["gpu"] = None
    try:
        result["instance_id"] = llm.llm_engine.vllm_config.instance_id
    except Exception:
        result["instance_id"] = None
    save()
    log(f"[{spec['role']}] engine up in {result['engine_init_s']:.1f} s")
    try:
        sc = llm.llm_engine.vllm_config.scheduler_config
        result["scheduler"] = {
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "async_scheduling": getattr(sc, "async_scheduling", None),
        }
        cc = llm.llm_engine.vllm_config.cache_config
        result["gpu_kv_blocks"] = getattr(cc, "num_gpu_blocks", None)
    except Exception as exc:
        result["errors"].append(f"config read: {exc!r}")

    block_bytes = int(getattr(llm, "ttft_block_bytes", 0) or kv_bytes_per_token(spec["shape"]) * BLOCK_TOKENS)
    result["block_bytes"] = block_bytes
    mgr = conn = tier = probe = None
    if not inproc:
        log(f"[{spec['role']}] engine core in its own process: no tier object here; origin from the nodes' counters")
        if tier_kind == "memkv" and os.environ.get(PROBE_ENV):  # the engine core's tier writes its stages there
            probe = FileProbe(os.environ[PROBE_ENV])
            result["probe_installed"] = probe.installed
    elif tier_kind == "none":
        mgr, _sched, conn = find_manager(llm)
    else:
        mgr, _sched, conn = find_manager(llm)
        tier = mgr.secondary_tiers[0]
        result["tier_class"] = type(tier).__name__
    if (
        tier is not None and tier_kind == "memkv"
    ):  # which transport the loads took (MEMKV_TRANSPORT, UCX_TLS from the environment)
        result["transport"] = {
            "MEMKV_TRANSPORT": os.environ.get("MEMKV_TRANSPORT", "auto"),
            "UCX_TLS": os.environ.get("UCX_TLS"),
            "has_rdma": tier.client.has_rdma(),
        }
        log(f"memkv transport: {result['transport']}")
    try:
        result["primary_blocks"] = mgr.primary_tier.get_kv_memoryview().shape[0] if mgr else None
    except Exception:
        result["primary_blocks"] = None
    if tier is not None:
        probe = TierProbe(tier, tier_kind)
        result["probe_installed"] = probe.installed
        log(f"[{spec['role']}] tier {type(tier).__name__}; instrumented: {probe.installed}")

    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, logprobs=5)
    sp_plain = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    use_logprobs = [True]

    def generate(ids):
        p = TokensPrompt(prompt_token_ids=ids)
        if use_logprobs[0]:
            try:
                return llm.generate([p], sp, use_tqdm=False)[0]
            except Exception as exc:
                result["errors"].append(f"logprobs disabled: {exc!r}")
                use_logprobs[0] = False
        return llm.generate([p], sp_plain, use_tqdm=False)[0]

    tiny_rng = random.Random(99)

    def pending() -> bool:
        try:
            return bool(conn.has_pending_push_work())
        except Exception:
            return bool(mgr.has_pending_work())

    settle_limit = [60.0]

    def settle() -> float:
        """Step the engine until no GPU<->CPU job and no tier job is pending (in-process, the
        engine only steps while something drives it). Returns the seconds it took. With the
        engine core in its own process it steps by itself while the connector has push work
        (Scheduler.has_requests): there this is a no-op; reset() retries and wait_stored() waits."""
        if not inproc:
            return 0.0
        t = time.perf_counter()
        n = 0
        limit_s = settle_limit[0]
        while pending() and time.perf_counter() - t < limit_s:
            try:
                llm.llm_engine.step()
            except Exception:
                generate([tiny_rng.randrange(3, vocab) for _ in range(8)])  # < 1 block: stores nothing
            n += 1
            if n % 50 == 0:
                time.sleep(0.005)
        if pending():
            result["errors"].append(f"settle: still pending after {limit_s} s")
            settle_limit[0] = 3.0  # something never settles: do not let it eat the budget
        return time.perf_counter() - t

    # Runs whose blocks must all come from MemKV: the nodes must have sent at least the prompt's
    # KV bytes (full 64-token blocks x block bytes) during the timed span.
    from_memkv = {"memkv", "restart_memkv", "sweep_memkv"}

    def nodes_now() -> dict | None:
        return node_counters(admin_ports) if admin_ports else None

    def one_run(phase: str, tokens: int, rep: int, ids: list[int], extra: dict | None = None) -> dict:
        before_t = tier_totals(tier) if tier is not None else {}
        before_m = metrics_snapshot(llm)
        before_n = nodes_now()
        if probe:
            probe.reset()
        w0, t0 = time.time(), time.perf_counter()
        out = generate(ids)
        t1, w1 = time.perf_counter(), time.time()
        comp = out.outputs[0]
        rec = {
            "phase": phase,
            "tokens": tokens,
            "rep": rep,
            "seconds": t1 - t0,
            "token_ids": list(comp.token_ids),
            "num_cached_tokens": getattr(out, "num_cached_tokens", None),
            "prompt_kv_bytes": (tokens // BLOCK_TOKENS) * block_bytes,
        }
        try:
            if comp.logprobs:
                lp = comp.logprobs[0]
                rec["top5"] = [[int(k), float(v.logprob)] for k, v in sorted(lp.items(), key=lambda kv: -kv[1].logprob)]
        except Exception as exc:
            rec["top5_error"] = repr(exc)
        rec["timeline"] = probe.timeline(w0, w1) if probe else {"total_s": t1 - t0}
        rec["stages"] = stages(rec["timeline"])
        rec["tier_counters"] = diff(tier_totals(tier), before_t) if tier is not None else {}
        rec["prom"] = diff(metrics_snapshot(llm), before_m)
        if before_n is not None:
            nd = node_delta(nodes_now(), before_n)
            if phase in from_memkv and nd["sent"] < rec["prompt_kv_bytes"] and not nd["errors"]:
                # The node counts a GET's bytes right after its reply went out: give a late count a moment.
                nd, waited, _ = wait_nodes(admin_ports, before_n, "sent", rec["prompt_kv_bytes"], 2.0, quiet_s=1.0)
                rec["node_recheck_s"] = waited
            rec["nodes"] = nd
            rec["memkv_sent_bytes"] = nd["sent"]
            if phase in from_memkv:
                ok = nd["sent"] >= rec["prompt_kv_bytes"] and not nd["errors"]
                rec["origin_ok"] = ok
                if not ok:
                    msg = (
                        f"ORIGIN {phase} {tokens} tok rep{rep}: nodes sent {nd['sent'] / 2**30:.3f} GiB, prompt KV is "
                        f"{rec['prompt_kv_bytes'] / 2**30:.3f} GiB ({tokens // BLOCK_TOKENS} blocks); node errors {nd['errors']}"
                    )
                    result.setdefault("origin_errors", []).append(msg)
                    log(msg)
        if extra:
            rec.update(extra)
        result["runs"].append(rec)
        tl = rec["timeline"]
        lb = sum(v for k, v in rec["tier_counters"].items() if "load_bytes" in k)
        sent = rec.get("memkv_sent_bytes")
        log(
            f"[{spec['role']}] {phase:<14} {tokens:>6} tok rep{rep}: {rec['seconds']:.3f} s  tok={rec['token_ids']} "
            f"cached={rec['num_cached_tokens']} nodes_sent={'-' if sent is None else f'{sent / 2**30:.2f}'} GiB "
            f"of {rec['prompt_kv_bytes'] / 2**30:.2f} "
            + (
                f"tier_load={lb / 2**30:.2f} GiB submit@{tl.get('first_submit_load_s', float('nan')):.3f} "
                f"job={tl.get('load_job_s')} taken@{tl.get('last_job_taken_s', float('nan')):.3f}"
                if probe
                else ""
            )
            + (f" core={tl['engine_core_during_load']}" if "engine_core_during_load" in tl else "")
            + (f" node_cpu={rec['nodes']['cpu_s']:.2f}s" if rec.get("nodes", {}).get("cpu_s") else "")
        )
        save()
        return rec

    def reset(connector: bool) -> float:
        """reset_prefix_cache; with the engine core in its own process a reset right after a run
        can find the GPU blocks still pinned by stores in flight (returns False): retry, bounded."""
        t = time.perf_counter()
        tries = 0
        while True:
            tries += 1
            ok = llm.reset_prefix_cache(reset_connector=True) if connector else llm.reset_prefix_cache()
            if ok is not False or inproc or time.perf_counter() - t > 30.0:
                break
            time.sleep(0.05)
        if ok is False:
            result["errors"].append(f"reset_prefix_cache(reset_connector={connector}) returned False ({tries} tries)")
        if tries > 1:
            result.setdefault("reset_retries", []).append(tries)
        return time.perf_counter() - t

    def wait_stored(before_n: dict | None, tokens: int, what: str) -> dict | None:
        """Engine core in its own process: wait until the nodes received the prompt's blocks (the
        cascade GPU -> CPU pool -> MemKV runs after the request), bounded; inproc: settle() did."""
        if before_n is None or tier_kind != "memkv":
            return None
        expected = (tokens // BLOCK_TOKENS) * block_bytes
        d, waited, reached = wait_nodes(admin_ports, before_n, "received", expected, spec.get("store_wait_s", 60.0))
        info = {
            "what": what,
            "received": d["received"],
            "expected": expected,
            "seconds": round(waited, 3),
            "reached": reached,
        }
        result.setdefault("store_waits", []).append(info)
        if not reached:
            msg = (
                f"STORE {what}: the nodes received {d['received'] / 2**30:.3f} GiB of the prompt's "
                f"{expected / 2**30:.3f} GiB within {waited:.1f} s"
            )
            result["errors"].append(msg)
            log(msg)
        return info

    def apply_setting(threads: int, bpo: int, si_ms: float | None, chunk_mib: int | None = None) -> None:
        import dataclasses

        from memkv_vllm.transfers import TransferPool

        tier.drain_jobs()
        if tier.settings.n_read_threads != threads:
            old = tier._pool
            new = TransferPool(threads, tier.settings.n_write_threads, tier.settings.load_failure_grace_s)
            probe.wrap_pool(new)
            tier._pool = new
            old.shutdown()
        tier.settings = dataclasses.replace(tier.settings, n_read_threads=threads, blocks_per_op=bpo)
        sys.setswitchinterval((si_ms if si_ms else 5.0) / 1000.0)
        result.setdefault("verify_chunk_bytes", []).append(set_verify_chunk(chunk_mib or spec.get("verify_chunk_mib")))

    try:
        # Warm-up: kernels, allocator, the tier's connections (not measured).
        before_n = nodes_now()
        for n in (512, 4096):
            generate(prompt_ids(n, 424242 + n, vocab))
        settle()
        if not inproc and spec["phases"] != ["restart"]:
            wait_stored(before_n, 512 + 4096, "warm-up")
        if spec.get("switch_interval_ms"):
            sys.setswitchinterval(spec["switch_interval_ms"] / 1000.0)
        if tier_kind == "memkv" and spec.get("verify_chunk_mib"):
            result["verify_chunk_bytes"] = [set_verify_chunk(spec["verify_chunk_mib"])]

        # ---- sweep of tier settings (main engine, memkv) -----------------------------------------
        if spec.get("sweep") and tier_kind == "memkv" and tier is not None:
            L = spec["sweep_tokens"]
            ids = prompt_ids(L, sweep_seed(L), vocab)
            one_run("sweep_recompute", L, 0, ids)
            settle()
            sweep = []
            for item in spec["sweep"]:
                if time.time() > deadline - spec.get("reserve_s", 0):
                    result["errors"].append("sweep cut short by the deadline")
                    break
                threads, bpo, si, chunk = item
                apply_setting(threads, bpo, si, chunk)
                times = []
                for r in range(spec.get("sweep_reps", 2)):
                    reset(True)
                    rec = one_run(
                        "sweep_memkv",
                        L,
                        r,
                        ids,
                        {
                            "setting": {
                                "threads": threads,
                                "blocks_per_op": bpo,
                                "switch_interval_ms": si,
                                "verify_chunk_mib": chunk,
                            }
                        },
                    )
                    times.append(rec["seconds"])
                    settle()
                sweep.append(
                    {
                        "threads": threads,
                        "blocks_per_op": bpo,
                        "switch_interval_ms": si,
                        "verify_chunk_mib": chunk,
                        "seconds": times,
                    }
                )
            result["sweep"] = sweep
            if sweep:
                best = min(sweep, key=lambda s: statistics.median(s["seconds"]))
                result["best"] = best
                log(f"[{spec['role']}] best setting: {best}")
                apply_setting(
                    best["threads"], best["blocks_per_op"], best["switch_interval_ms"], best.get("verify_chunk_mib")
                )
            save()

        # ---- the matrix ----------------------------------------------------------------------------
        phases = spec["phases"]
        for L in spec["tokens"]:
            for rep in range(spec["reps"]):
                if time.time() > deadline:
                    result["errors"].append(f"deadline: skipped {L} rep{rep} and later")
                    raise TimeoutError("deadline")
                ids = prompt_ids(L, prompt_seed(L, rep), vocab)
                if "restart" in phases:
                    one_run("restart_" + tier_kind, L, rep, ids)
                    settle()
                    continue
                before_n = nodes_now()
                one_run("recompute" if tier_kind != "none" else "recompute_notier", L, rep, ids)
                result.setdefault("settle_after_recompute_s", []).append(settle())
                if "cold_only" in phases:  # notier: the cold run alone, nothing to revisit
                    reset(False)
                    continue
                if not inproc:  # the cascade to MemKV done before the next timed run
                    wait_stored(before_n, L, f"{L} tok rep{rep}")
                if "cpu_hit" in phases:
                    reset(False)
                    one_run("cpu_hit", L, rep, ids)
                    settle()
                rs = reset(True)  # drains the tier's stores, empties the CPU pool
                one_run(tier_kind, L, rep, ids, {"reset_s": rs})
                settle()
                if tier_kind == "fs" and spec.get("fs_clean", True):
                    # Free the disk for the next prompt (this prompt is not revisited by this engine).
                    shutil.rmtree(spec["tier"]["root_dir"], ignore_errors=True)
                    os.makedirs(spec["tier"]["root_dir"], exist_ok=True)
    except TimeoutError:
        pass
    except Exception:
        result["errors"].append(traceback.format_exc())
        log(traceback.format_exc())
    result["tier_totals"] = tier_totals(tier) if tier is not None else {}
    result["prom_final"] = metrics_snapshot(llm)
    save()
    log(f"[{spec['role']}] done; errors: {len(result['errors'])}")
    if not inproc:
        shutdown_engine_core(llm)
    # The CPU pool is a /dev/shm file that vLLM unlinks only on a clean shutdown.
    try:
        iid = result.get("instance_id")
        for path in glob.glob(f"/dev/shm/vllm_offload_{glob.escape(iid)}*") if iid else []:
            os.unlink(path)
    except Exception as exc:
        log(f"could not unlink the CPU pool file: {exc!r}")
    # Exit without tearing the engine down politely: a stuck shutdown must not eat the budget.
    sys.stdout.flush()
    os._exit(0)


# =================================================================================================
# Orchestrator
# =================================================================================================


def parse_sweep(text: str) -> list:
    """'16x1,16x2s0.5,16x4c4' -> [(16,1,None,None),(16,2,0.5,None),(16,4,None,4)]: read threads x
    blocks_per_op [c receive/verify chunk in MiB (experiment: patches the client)] [s GIL switch
    interval in ms]."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = re.fullmatch(r"(\d+)x(\d+)(?:c(\d+))?(?:s([\d.]+))?", item)
        if not m:
            raise SystemExit(f"bad sweep item {item!r}")
        out.append(
            (
                int(m.group(1)),
                int(m.group(2)),
                float(m.group(4)) if m.group(4) else None,
                int(m.group(3)) if m.group(3) else None,
            )
        )
    return out


def set_verify_chunk(mib: int | None) -> int:
    """EXPERIMENT: the client receives a value in chunks of memkv.transport.stream._VERIFY_CHUNK (16 MiB by default)
    and hashes each chunk; every chunk costs two GIL round trips. Returns the chunk in force."""
    from memkv.transport import stream as streammod

    if not hasattr(streammod, "_VERIFY_CHUNK"):
        log("verify-chunk experiment unavailable: memkv.transport.stream has no _VERIFY_CHUNK")
        return 0
    if not hasattr(streammod, "_DEFAULT_VERIFY_CHUNK"):
        streammod._DEFAULT_VERIFY_CHUNK = streammod._VERIFY_CHUNK
    streammod._VERIFY_CHUNK = (mib << 20) if mib else streammod._DEFAULT_VERIFY_CHUNK
    return streammod._VERIFY_CHUNK


def host_info() -> dict:
    info = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        info["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except Exception as exc:
        info["gpu"] = repr(exc)
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except Exception:
        pass
    return info


def shutdown_engine_core(llm, timeout_s: float = 20.0) -> None:
    """Engine core in its own process: stop it (and its workers) before this process exits, or it
    would keep the GPU from the next engine. vLLM's shutdown first, bounded; then SIGTERM/SIGKILL
    to whatever of our descendants is left, by pid."""
    try:
        import psutil

        kids = psutil.Process().children(recursive=True)
    except Exception:
        kids = []
    th = threading.Thread(target=lambda: llm.llm_engine.engine_core.shutdown(), daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        log(f"engine core shutdown still running after {timeout_s} s: terminating its processes")
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        alive = [k for k in kids if k.is_running()]
        if not alive:
            break
        for k in alive:
            try:
                k.send_signal(sig)
            except Exception:
                pass
        end = time.monotonic() + wait_s
        while time.monotonic() < end and any(k.is_running() and k.status() != "zombie" for k in alive):
            time.sleep(0.1)


def kill_group(pgid: int) -> None:
    """What is left of an engine child's process group (it runs in its own session), by id."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(2.0 if sig == signal.SIGTERM else 0.5)


def run_child(spec: dict, env: dict, timeout_s: float) -> dict | None:
    spec_path = spec["out"] + ".spec"
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    if not spec.get("inproc"):  # in-process, ttft.py wraps the tier object itself (no second probe)
        probe_file = spec["out"] + ".probe.jsonl"  # the engine core's stage timestamps (tier_probe.py)
        if os.path.exists(probe_file):
            os.unlink(probe_file)
        env = {**env, PROBE_ENV: probe_file}
    t = time.perf_counter()
    # Own session: on a timeout the whole group goes (engine core and workers included), so a
    # hung engine cannot hold the GPU into the next phase or call.
    p = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--engine-child", spec_path], env=env, start_new_session=True
    )
    try:
        rc = p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = "timeout"
        log(f"engine {spec['role']}: past its {timeout_s:.0f} s; killing its process group")
    kill_group(p.pid)
    if rc == "timeout":
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    wall = time.perf_counter() - t
    log(f"engine {spec['role']}: exit {rc} after {wall:.1f} s")
    try:
        with open(spec["out"]) as f:
            res = json.load(f)
    except Exception:
        return {"role": spec["role"], "runs": [], "errors": [f"no result (exit {rc})"], "wall_s": wall}
    # A killed child leaves its CPU pool file in /dev/shm (only this engine's: others may share the host).
    if res.get("instance_id"):
        for path in glob.glob(f"/dev/shm/vllm_offload_{glob.escape(res['instance_id'])}*"):
            try:
                os.unlink(path)
                log(f"removed leftover {path}")
            except OSError:
                pass
    res["wall_s"] = wall
    res["exit"] = rc
    return res


def raw_tcp_baseline(
    tokens: list[int], reps: int, servers: int, threads: int, block_bytes: int, deadline: float
) -> list[dict]:
    """The remote promotion's yardstick: bench/datapath.py's raw design (a blocking Python socket
    per thread, one request header, `recv_into` a pre-faulted pool; no framing, MAC, checksum or
    store) over loopback TCP, `servers` server processes (one per MemKV node) holding the
    prompt's blocks round-robin, fetched by `threads` threads of this process (the tier's
    n_read_threads) into one pre-faulted buffer: the same bytes a promotion moves, the same
    fan-out, in the same call. One warm-up fetch of the longest prompt first (connections made,
    target faulted in)."""
    sys.path.insert(0, os.path.dirname(HERE))  # bench/
    from concurrent.futures import ThreadPoolExecutor

    from datapath import RawClient, start_raw

    from memkv.benchmark import prefaulted_pool

    most = max(tokens) // BLOCK_TOKENS
    procs = [start_raw(block_bytes, -(-most // servers)) for _ in range(servers)]
    clients = [RawClient(port) for _, port, _ in procs]
    target = memoryview(prefaulted_pool(most * block_bytes))
    rows: list[dict] = []

    def fetch(blocks: int, part: int) -> None:
        for b in range(part, blocks, threads):
            clients[b % servers].get(b // servers, target[b * block_bytes : (b + 1) * block_bytes])

    try:
        with ThreadPoolExecutor(threads) as pool:

            def timed(blocks: int) -> float:
                t0 = time.perf_counter()
                for f in [pool.submit(fetch, blocks, part) for part in range(threads)]:
                    f.result()
                return time.perf_counter() - t0

            timed(most)
            for length in tokens:
                blocks = length // BLOCK_TOKENS
                for rep in range(reps):
                    if time.time() > deadline:
                        log(f"raw TCP baseline: out of time at {length} tokens")
                        return rows
                    dt = timed(blocks)
                    rows.append(
                        {"tokens": length, "rep": rep, "bytes": blocks * block_bytes, "seconds": dt,
                         "gb_s": blocks * block_bytes / dt / 1e9}
                    )  # fmt: skip
                    log(f"raw TCP baseline: {length} tokens rep {rep}: {dt:.3f} s, {rows[-1]['gb_s']:.1f} GB/s")
    finally:
        for c in clients:
            c.close()
        for proc, _, _ in procs:
            proc.kill()
            proc.wait()
    return rows


def summarize(engines: dict) -> tuple[list, list]:
    """Rows per prompt length and the output-consistency problems."""
    by = {}
    outputs = {}
    top5_agreement = []
    for role, res in engines.items():
        for r in res.get("runs", []):
            if r["phase"].startswith("sweep"):
                key = ("sweep", r["tokens"], 0)
                outputs.setdefault(key, []).append((role, r["phase"], r["token_ids"], r.get("top5")))
                continue
            by.setdefault(r["tokens"], {}).setdefault(r["phase"], []).append(r["seconds"])
            outputs.setdefault(("p", r["tokens"], r["rep"]), []).append(
                (role, r["phase"], r["token_ids"], r.get("top5"))
            )
    problems = []
    for key, outs in sorted(outputs.items()):
        toks = {tuple(o[2]) for o in outs}
        if len(toks) > 1:
            problems.append({"prompt": list(key), "outputs": [(o[0], o[1], o[2]) for o in outs]})
        # Top-5 logprobs: served-from-cache phases compute the same last block from the same KV
        # bytes, so they should agree bit for bit; recompute may differ in the last bits.
        hit = {json.dumps(o[3]) for o in outs if o[3] is not None and "recompute" not in o[1]}
        allp = {json.dumps(o[3]) for o in outs if o[3] is not None}
        top5_agreement.append(
            {"prompt": list(key), "phases": len(outs), "distinct_top5_hits": len(hit), "distinct_top5_all": len(allp)}
        )
    rows = []
    for L in sorted(by):
        rows.append({"tokens": L, **{ph: v for ph, v in by[L].items()}})
    return rows, problems, top5_agreement


def fmt_times(v) -> str:
    if not v:
        return "-"
    return " / ".join(f"{x:.2f}" for x in v)


def breakdown_rows(engines: dict, raw_tcp: list[dict] | None = None) -> list[dict]:
    """Per promotion run: the stages (tier_probe.stages), the ratio to the median CPU-pool hit
    of the same prompt length in the same engine (the main engine's for a restarted engine,
    which has no CPU-pool hit of its own; marked), and the MemKV -> pool stage's GB/s against
    the median raw TCP fetch of the same bytes in the same call (`raw_tcp_baseline`)."""
    raw_gb_s: dict[int, list[float]] = {}
    for r in raw_tcp or []:
        raw_gb_s.setdefault(r["tokens"], []).append(r["gb_s"])
    cpu = {}
    for role, res in engines.items():
        for r in res.get("runs", []):
            if r["phase"] == "cpu_hit":
                cpu.setdefault((role, r["tokens"]), []).append(r["seconds"])
    out = []
    for role, res in engines.items():
        for r in res.get("runs", []):
            if r["phase"] not in ("memkv", "restart_memkv", "fs"):
                continue
            hit, same = cpu.get((role, r["tokens"])), True
            if not hit:
                hit, same = cpu.get(("main", r["tokens"])), False
            st = r.get("stages") or {}
            if (r.get("timeline") or {}).get("loader_phases"):
                st = {**st, "loader_phases": r["timeline"]["loader_phases"]}
            moved = r.get("prompt_kv_bytes")
            gb_s = moved / st["memkv_to_pool_s"] / 1e9 if moved and st.get("memkv_to_pool_s") else None
            raw = statistics.median(raw_gb_s[r["tokens"]]) if r["tokens"] in raw_gb_s else None
            out.append(
                {
                    "engine": role,
                    "phase": r["phase"],
                    "tokens": r["tokens"],
                    "rep": r["rep"],
                    "total_s": r["seconds"],
                    **st,
                    "memkv_to_pool_gb_s": gb_s,
                    "raw_tcp_gb_s": raw,
                    "ratio_to_raw_tcp": gb_s / raw if gb_s and raw else None,
                    "cpu_hit_s": statistics.median(hit) if hit else None,
                    "cpu_hit_same_engine": same,
                    "ratio_to_cpu_hit": r["seconds"] / statistics.median(hit) if hit else None,
                }
            )
    return out


def print_breakdown(rows: list[dict]) -> None:
    if not rows:
        return
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    g = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print(
        "\n| engine | phase | tokens | rep | total s | lookup s | MemKV -> pool s | pool -> GPU + token s | CPU-pool hit s "
        "| x CPU-pool hit | MemKV -> pool GB/s | raw TCP GB/s | x raw TCP |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = (
            "-"
            if r["ratio_to_cpu_hit"] is None
            else f"{r['ratio_to_cpu_hit']:.2f}x" + ("" if r["cpu_hit_same_engine"] else " (main's)")
        )
        print(
            f"| {r['engine']} | {r['phase']} | {r['tokens']:,} | {r['rep']} | {f(r['total_s'])} | {f(r.get('lookup_s'))} | "
            f"{f(r.get('memkv_to_pool_s'))} | {f(r.get('pool_to_gpu_token_s'))} | {f(r['cpu_hit_s'])} | {ratio} | "
            f"{g(r.get('memkv_to_pool_gb_s'))} | {g(r.get('raw_tcp_gb_s'))} | {f(r.get('ratio_to_raw_tcp'))} |"
        )
    for r in rows:
        if r.get("loader_phases"):
            print(
                f"loader phases, {r['engine']} {r['phase']} {r['tokens']:,} rep {r['rep']} (s summed over threads / calls): "
                + ", ".join(f"{k} {v['seconds']:.3f}/{v['calls']}" for k, v in r["loader_phases"].items())
            )


def print_table(rows: list) -> None:
    cols = [
        ("recompute", "recompute"),
        ("cpu_hit", "CPU-pool hit"),
        ("memkv", "MemKV promotion"),
        ("restart_memkv", "MemKV after restart"),
        ("fs", "fs tier promotion"),
    ]
    notier = any(r.get("recompute_notier") for r in rows)
    if notier:
        cols.append(("recompute_notier", "recompute, no secondary tier"))
    head = (
        "| tokens | "
        + " | ".join(c[1] for c in cols)
        + " | recompute/MemKV | fs/MemKV |"
        + (" recompute with/without tier |" if notier else "")
    )
    print(head)
    print("|" + "---|" * (len(cols) + 3 + notier))
    for r in rows:
        mk = r.get("memkv") or r.get("restart_memkv")
        rc = r.get("recompute")
        fs = r.get("fs")
        s1 = f"{statistics.median(rc) / statistics.median(mk):.1f}x" if rc and mk else "-"
        s2 = f"{statistics.median(fs) / statistics.median(mk):.1f}x" if fs and mk else "-"
        nt = r.get("recompute_notier")
        s3 = f" {statistics.median(rc) / statistics.median(nt):.3f} |" if rc and nt else (" - |" if notier else "")
        print(f"| {r['tokens']:,} | " + " | ".join(fmt_times(r.get(c[0])) for c in cols) + f" | {s1} | {s2} |" + s3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-child", help=argparse.SUPPRESS)
    ap.add_argument(
        "--phases",
        default="main,restart",
        help="engines to run, in order, from main,restart,fs,notier (notier: TieringOffloadingSpec with "
        "no secondary tier, cold runs only), and raw: no engine, the raw TCP fetch of each prompt's bytes "
        "from --nodes server processes with the tier's read threads (the MemKV -> pool stage's yardstick)",
    )
    ap.add_argument("--tokens", default="8192,32768,65536")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--fs-tokens", default=None, help="prompt lengths for the fs engine (default: --tokens)")
    ap.add_argument("--fs-reps", type=int, default=None)
    ap.add_argument("--notier-tokens", default=None, help="prompt lengths for the notier engine (default: --tokens)")
    ap.add_argument("--notier-reps", type=int, default=None, help="cold runs per length in notier (default: --reps)")
    ap.add_argument(
        "--loader-phases",
        action="store_true",
        help="also time the MemKV client's load-path calls in the engine core (tier_probe.LoaderPhases: "
        "chunk loads, node replies, notification waits, verification; seconds summed over the "
        "loader threads), printed per promotion run",
    )
    ap.add_argument(
        "--inproc",
        action="store_true",
        help="engine core in the engine's process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the tier object is "
        "reachable (tier counters, --sweep). Default: vLLM's own layout, engine core "
        "in its own process, as `vllm serve` runs it",
    )
    ap.add_argument(
        "--tier-json",
        default=None,
        help=f"the memkv tier config (JSON object); default README's {json.dumps(README_TIER)}",
    )
    ap.add_argument("--shape", default="32b", choices=sorted(SHAPES))
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine (needs that many GPUs)")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--node-capacity", default="20GiB")
    ap.add_argument("--max-value-size", default="64MiB")
    ap.add_argument("--node-args", default="", help="extra `memkv serve` arguments")
    ap.add_argument("--pool-size", type=int, default=16, help="client connections per node (MEMKV_CONFIG pool_size)")
    # Tuning keys: none by default (README's config); each one given is added to the tier config.
    ap.add_argument("--read-threads", type=int, default=None, help="tier key n_read_threads")
    ap.add_argument("--write-threads", type=int, default=None, help="tier key n_write_threads")
    ap.add_argument("--blocks-per-op", type=int, default=None, help="tier key blocks_per_op")
    ap.add_argument("--store-backlog-mb", type=int, default=None, help="tier key max_store_backlog_mb")
    ap.add_argument("--step-yield-ms", type=float, default=None, help="tier key step_yield_ms")
    ap.add_argument(
        "--switch-interval-ms", type=float, default=None, help="sys.setswitchinterval in the engine process"
    )
    ap.add_argument(
        "--verify-chunk-mib",
        type=int,
        default=None,
        help="EXPERIMENT: patch the client's receive/verify chunk (default: the client's 1 MiB)",
    )
    ap.add_argument(
        "--sweep",
        default="",
        help="main engine (needs --inproc): read threads x blocks_per_op [s switch interval ms], e.g. "
        "16x1,16x2,16x4,16x8,8x2,32x2,16x1s0.5,16x2s0.5; the best is applied for the rest. Default: none",
    )
    ap.add_argument("--sweep-tokens", type=int, default=32768)
    ap.add_argument("--sweep-reps", type=int, default=2)
    ap.add_argument("--cpu-gib", type=float, default=24.0)
    ap.add_argument("--gpu-util", type=float, default=0.88)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--fs-root", default="/tmp/ttft-fs")
    ap.add_argument("--fs-threads", type=int, default=16)
    ap.add_argument(
        "--store-wait-s",
        type=float,
        default=60.0,
        help="engine core in its own process: bound on waiting for a prompt's cascade to reach the nodes",
    )
    ap.add_argument("--state-dir", default="/tmp/ttft-state")
    ap.add_argument(
        "--keep-nodes", action="store_true", help="leave the nodes running (detached) for a later invocation"
    )
    ap.add_argument("--reuse-nodes", action="store_true", help="use the nodes recorded in --state-dir")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--budget-s", type=float, default=560.0, help="wall-clock budget of this invocation")
    args = ap.parse_args()

    if args.engine_child:
        with open(args.engine_child) as f:
            return engine_child(json.load(f))

    t_start = time.time()
    deadline = t_start + args.budget_s
    phases = [p for p in args.phases.split(",") if p]
    tokens = [int(x) for x in args.tokens.split(",") if x]
    fs_tokens = [int(x) for x in args.fs_tokens.split(",")] if args.fs_tokens else tokens
    notier_tokens = [int(x) for x in args.notier_tokens.split(",")] if args.notier_tokens else tokens
    if args.sweep and not args.inproc:
        raise SystemExit("--sweep swaps settings on the live tier object: it needs --inproc")
    os.makedirs(args.out_dir, exist_ok=True)
    os.makedirs(args.state_dir, exist_ok=True)
    tag = "-".join(phases) + (f"-tp{args.tp}" if args.tp > 1 else "")
    kv_per_token = kv_bytes_per_token(args.shape)
    meta = {"host": host_info(), "args": vars(args), "block_tokens": BLOCK_TOKENS, "kv_bytes_per_token": kv_per_token}
    from memkv.sockio import COMPILED_RECEIVE  # the engine core inherits MEMKV_PURE_PYTHON, so the same

    meta["receive_loop"] = "compiled" if COMPILED_RECEIVE else "python"
    log(f"host: {meta['host']}")

    state = None
    need_nodes = any(p in ("main", "restart", "notier") for p in phases)
    if need_nodes:
        if args.reuse_nodes:
            with open(os.path.join(args.state_dir, "nodes.json")) as f:
                state = json.load(f)
            log(f"reusing memkv nodes {[n['address'] for n in state['nodes']]}")
        else:
            state = start_nodes(
                args.nodes, args.node_capacity, args.max_value_size, args.state_dir, args.node_args.split()
            )
    # The plugin's entry point, as an installed memkv has it: vLLM then registers the tier in the
    # engine core process too (that process is not ours to call register() in).
    ep_dir = write_entry_point(os.path.join(args.state_dir, "entry-point"))
    env = {
        **os.environ,
        "PYTHONHASHSEED": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if args.inproc else "1",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [ep_dir, HERE, os.environ.get("PYTHONPATH")])),
    }
    if args.loader_phases:
        env[PROBE_PHASES_ENV] = "1"
    meta["process_layout"] = (
        "in-process engine core" if args.inproc else "engine core in its own process (vLLM default)"
    )
    if state:
        cfg_path = os.path.join(args.state_dir, "client.yaml")
        with open(cfg_path, "w") as f:
            f.write(f"pool_size: {args.pool_size}\nio_timeout_s: 30\n")
        env.update(
            MEMKV_SERVERS=",".join(n["address"] for n in state["nodes"]),
            MEMKV_AUTH_KEY=state["key"],
            MEMKV_CONFIG=cfg_path,
        )
        meta["memkv_nodes"] = [n["address"] for n in state["nodes"]]

    memkv_tier = json.loads(args.tier_json) if args.tier_json else dict(README_TIER)
    for key, v in (
        ("n_read_threads", args.read_threads),
        ("n_write_threads", args.write_threads),
        ("blocks_per_op", args.blocks_per_op),
        ("max_store_backlog_mb", args.store_backlog_mb),
        ("step_yield_ms", args.step_yield_ms),
    ):
        if v is not None:
            memkv_tier[key] = v
    meta["memkv_tier"] = memkv_tier
    meta["readme_tier"] = memkv_tier == README_TIER
    log(
        f"memkv tier config: {json.dumps(memkv_tier)}{' (README.md, no tuned keys)' if meta['readme_tier'] else ''}; "
        f"{meta['process_layout']}"
    )
    common = dict(
        shape=args.shape,
        tp=args.tp,
        cpu_gib=args.cpu_gib,
        gpu_util=args.gpu_util,
        eager=not args.no_eager,
        max_num_batched_tokens=args.max_num_batched_tokens,
        switch_interval_ms=args.switch_interval_ms,
        verify_chunk_mib=args.verify_chunk_mib,
        inproc=args.inproc,
        store_wait_s=args.store_wait_s,
        admin_ports=[n["admin"] for n in state["nodes"]] if state else [],
    )
    engines: dict = {}
    raw_tcp: list[dict] = []
    out_json = os.path.join(args.out_dir, f"ttft-{tag}.json")

    def save():
        rows, problems, top5 = summarize(engines)
        doc = {
            "meta": meta,
            "engines": engines,
            "rows": rows,
            "output_mismatches": problems,
            "origin_errors": [e for res in engines.values() for e in res.get("origin_errors", [])],
            "top5_agreement": top5,
            "raw_tcp": raw_tcp,
            "breakdown": breakdown_rows(engines, raw_tcp),
            "elapsed_s": time.time() - t_start,
        }
        with open(out_json, "w") as f:
            json.dump(doc, f, indent=1)
        return rows, problems

    # Each engine leaves time for the ones after it (engine start included).
    need = {"main": 250.0, "restart": 100.0, "fs": 170.0, "notier": 90.0, "raw": 30.0}
    reserve = {role: sum(need.get(r, 0.0) for r in phases[i + 1 :]) for i, role in enumerate(phases)}
    try:
        for role in phases:
            left = deadline - time.time()
            if left < 60:
                log(f"skipping engine {role}: {left:.0f} s left")
                engines[role] = {"role": role, "runs": [], "errors": ["skipped: out of time"]}
                continue
            if role == "raw":
                block_bytes = kv_per_token * BLOCK_TOKENS
                threads = int(memkv_tier.get("n_read_threads", README_TIER["n_read_threads"]))
                raw_tcp[:] = raw_tcp_baseline(
                    tokens, args.reps, args.nodes, threads, block_bytes, deadline - reserve[role]
                )
                save()
                continue
            if role == "main":
                spec = dict(
                    common,
                    role="main",
                    tier=dict(memkv_tier),
                    tokens=tokens,
                    reps=args.reps,
                    phases=["cpu_hit"],
                    sweep=parse_sweep(args.sweep) if args.sweep else [],
                    sweep_tokens=args.sweep_tokens,
                    sweep_reps=args.sweep_reps,
                )
            elif role == "restart":
                tier = dict(memkv_tier)
                best = engines.get("main", {}).get("best")
                if best is None and args.reuse_nodes:
                    try:  # a previous invocation's main engine, same state dir
                        with open(os.path.join(args.state_dir, "best.json")) as f:
                            best = json.load(f)
                    except Exception:
                        best = None
                sw = args.switch_interval_ms
                vc = args.verify_chunk_mib
                if best:
                    tier.update(n_read_threads=best["threads"], blocks_per_op=best["blocks_per_op"])
                    sw = best.get("switch_interval_ms") or sw
                    vc = best.get("verify_chunk_mib") or vc
                spec = dict(
                    common,
                    role="restart",
                    tier=tier,
                    tokens=tokens,
                    reps=args.reps,
                    phases=["restart"],
                    switch_interval_ms=sw,
                    verify_chunk_mib=vc,
                )
            elif role == "fs":
                spec = dict(
                    common,
                    role="fs",
                    tier={
                        "type": "fs",
                        "root_dir": args.fs_root,
                        "n_read_threads": args.fs_threads,
                        "n_write_threads": args.fs_threads,
                    },
                    tokens=fs_tokens,
                    reps=args.fs_reps or args.reps,
                    phases=["cpu_hit"],
                )
            elif role == "notier":
                spec = dict(
                    common,
                    role="notier",
                    tier=None,
                    tokens=notier_tokens,
                    reps=args.notier_reps or args.reps,
                    phases=["cold_only"],
                )
            else:
                raise SystemExit(f"unknown phase {role}")
            spec["out"] = os.path.join(args.state_dir, f"engine-{role}.json")
            spec["deadline"] = deadline - reserve[role]
            engines[role] = run_child(spec, env, timeout_s=max(30.0, deadline - time.time()))
            if role == "main" and engines[role].get("best"):
                with open(os.path.join(args.state_dir, "best.json"), "w") as f:
                    json.dump(engines[role]["best"], f)
            save()
    finally:
        if state:
            meta["node_status"] = node_status(state)
            if not args.keep_nodes and not args.reuse_nodes:
                stop_nodes(state)
        rows, problems = save()
    print()
    print_table(rows)
    print_breakdown(breakdown_rows(engines, raw_tcp))
    for role, res in engines.items():
        if res.get("sweep"):
            print(f"\nsweep ({role}, {args.sweep_tokens} tokens, MemKV promotion seconds):")
            for s in res["sweep"]:
                print(
                    f"  threads={s['threads']:>2} blocks_per_op={s['blocks_per_op']:>2} "
                    f"switch_interval={s['switch_interval_ms'] or 5.0} ms "
                    f"verify_chunk={s.get('verify_chunk_mib') or 'default'} MiB: {fmt_times(s['seconds'])}"
                )
        for e in res.get("errors", []):
            print(f"  [{role}] error: {e.strip()[-600:]}")
    if problems:
        print("\nOUTPUT MISMATCH (greedy output differs between phases of one prompt):")
        for p in problems:
            print("  ", p)
    else:
        print("\ngreedy output identical in every phase of every prompt")
    # Origin: MemKV bytes the nodes served in each promotion run vs the prompt's KV bytes.
    origin = [(role, r) for role, res in engines.items() for r in res.get("runs", []) if "origin_ok" in r]
    if origin:
        print("\nMemKV bytes served by the nodes (memkv_node_sent_bytes_total, summed over nodes) per promotion run:")
        for role, r in origin:
            bb = engines[role].get("block_bytes") or 1
            print(
                f"  {role:<8} {r['phase']:<14} {r['tokens']:>6} tok rep{r['rep']}: {r['memkv_sent_bytes'] / 2**30:7.3f} GiB "
                f"of {r['prompt_kv_bytes'] / 2**30:7.3f} GiB ({r['memkv_sent_bytes'] / bb:.0f} of "
                f"{r['prompt_kv_bytes'] // bb} blocks)  {'ok' if r['origin_ok'] else 'SHORT'}  ({r['seconds']:.3f} s)"
            )
    origin_errors = [e for res in engines.values() for e in res.get("origin_errors", [])]
    if origin_errors:
        print("\nORIGIN MISMATCH (a promotion run was not served whole by MemKV):")
        for e in origin_errors:
            print("  ", e)
    elif origin:
        print("every promotion run was served whole by MemKV")
    no_run = [role for role, res in engines.items() if not res.get("runs")]
    if "raw" in phases and not raw_tcp:
        no_run.append("raw")
    if no_run:
        print(f"\nENGINES WITHOUT RUNS: {no_run}")
    print(f"wrote {out_json}")
    return 1 if problems or origin_errors or no_run else 0


if __name__ == "__main__":
    sys.exit(main())
