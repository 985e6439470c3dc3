#!/usr/bin/env python3
"""The real server path: `vllm serve` with README.md's `--kv-transfer-config`, an OpenAI-compatible
client, the server restarted on the same MemKV nodes, the same prompts again.

Runs on the GPU host (bench/gpu/stage.md), from the repository root, with src/ and vLLM on
PYTHONPATH. What it does:

  1. starts `--nodes` MemKV nodes on loopback (bench/gpu/ttft.py's node code, imported);
  2. reads the `--kv-transfer-config '...'` JSON from README.md (the line users copy) and starts
     `python3 -m vllm.entrypoints.cli.main serve <dummy model dir> --kv-transfer-config <it>`
     plus what a model without weights or tokenizer needs (--load-format dummy
     --skip-tokenizer-init --enforce-eager --max-model-len) and --port/--served-model-name;
     PYTHONHASHSEED=0; the engine in vLLM's own process layout; the memkv plugin loaded through
     its `vllm.general_plugins` entry point (a dist-info on PYTHONPATH, as `pip install memkv`
     leaves it); waits for /health (bounded);
  3. warms up (a 512- and a 4096-token prompt), then per prompt: POST /v1/completions with
     `prompt` = token ids, max_tokens 1, temperature 0, stream, return_token_ids, logprobs 5 as
     token ids; TTFT = request sent -> first streamed chunk carrying a token; around each
     request the server's /metrics (vllm:kv_offload_*, prefix-cache series) and the nodes'
     memkv_node_sent/received_bytes_total; after a cold request, waits (bounded) until the
     nodes received the prompt's blocks;
  4. stops the server (SIGINT to its process group, then SIGTERM, SIGKILL; bounded), starts a
     new one on the same nodes, sends the same prompts: each must be served whole by MemKV
     (nodes' sent bytes >= the prompt's KV bytes, and the server's
     vllm:kv_offload_memkv_load_bytes the same), with the same greedy token (and top-5);
  5. writes <out-dir>/serve.json, prints a table; exit status 1 on any mismatch or failure.

cpu_bytes_to_use is README's value unless --cpu-bytes is given. README's 16 GiB pool holds a
32k prompt (8 GiB, half the pool: the tier's default store backlog) but not a 64k one (16 GiB
of KV, the whole pool), so the default prompts are 8k/16k/32k; for 64k use --cpu-bytes
25769803776 (24 GiB, ttft.py's pool) --tokens 8192,32768,65536 and say so.

Dry run without a GPU (a stand-in server built on the fake engine of bench/gpu/dryrun, real
nodes, the real memkv tier): see bench/gpu/stage.md.
"""

from __future__ import annotations

import argparse
import glob
import http.client
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ttft  # noqa: E402  (nodes, prompts, model dir, node counters, entry point)
from ttft import BLOCK_TOKENS, log  # noqa: E402

REPO = ttft.REPO
SERVER_SERIES = (
    "vllm:kv_offload",
    "vllm:prefix_cache",
    "vllm:external_prefix_cache",
    "vllm:time_to_first_token",
    "vllm:num_requests",
    "vllm:request_success",
    "vllm:prompt_tokens",
)


def readme_kv_config(path: str) -> str:
    """The JSON after `--kv-transfer-config` in README.md's `vllm serve` line, verbatim."""
    with open(path) as f:
        text = f.read()
    m = re.search(r"vllm serve\b[^\n]*?--kv-transfer-config\s+'([^']+)'", text, re.S)
    if not m:
        raise SystemExit(f"no `vllm serve ... --kv-transfer-config '...'` line in {path}")
    raw = m.group(1)
    json.loads(raw)  # must be valid JSON as written
    return raw


def http_get(port: int, path: str, timeout_s: float = 5.0) -> tuple[int, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as r:
        return r.status, r.read().decode("utf-8", "replace")


def server_metrics(port: int) -> dict:
    try:
        _, text = http_get(port, "/metrics", 10.0)
    except Exception as exc:
        return {"_error": repr(exc)}
    out = {}
    for k, v in ttft.parse_prom(text, lambda n: n.startswith(SERVER_SERIES)).items():
        # drop the labels every series carries (engine, model_name), keep the rest
        name, _, labels = k.partition("{")
        lab = ",".join(x for x in labels.rstrip("}").split(",") if x and not x.startswith(("engine=", "model_name=")))
        key = f"{name}{{{lab}}}" if lab else name
        out[key] = out.get(key, 0.0) + v
    return out


def metric_diff(after: dict, before: dict) -> dict:
    return {
        k: v - before.get(k, 0.0)
        for k, v in after.items()
        if isinstance(v, float) and v - before.get(k, 0.0) and not k.endswith("_created")
    }


def server_load_bytes(m: dict) -> float:
    return sum(
        v for k, v in m.items() if k.startswith("vllm:kv_offload_memkv_load_bytes") and not k.endswith("_created")
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `vllm serve` process (own session: its API server, engine core and workers form one
    process group, stopped together)."""

    def __init__(self, argv: list[str], env: dict, log_path: str, port: int) -> None:
        self.argv, self.env, self.log_path, self.port = argv, env, log_path, port
        self.proc: subprocess.Popen | None = None
        self.shm_before: set[str] = set()

    def start(self, timeout_s: float) -> float:
        self.shm_before = set(glob.glob("/dev/shm/vllm_offload_*"))
        with open(self.log_path, "w") as f:  # the child keeps its own copy of the descriptor
            t0 = time.monotonic()
            self.proc = subprocess.Popen(
                self.argv, stdout=f, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before /health answered:\n{self.tail()}")
            try:
                code, _ = http_get(self.port, "/health", 2.0)
                if code == 200:
                    return time.monotonic() - t0
            except Exception:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"server not healthy after {timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(1.0)

    def tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def stop(self, grace_s: float = 40.0) -> dict:
        """SIGINT (what Ctrl-C does), then SIGTERM, then SIGKILL to the group; bounded."""
        info = {"signal": None, "seconds": 0.0, "returncode": None}
        if self.proc is None:
            return info
        t0 = time.monotonic()
        pgid = self.proc.pid
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            info["signal"] = sig.name
            end = time.monotonic() + wait_s
            while time.monotonic() < end:
                if self.proc.poll() is not None and not group_alive(pgid):
                    break
                time.sleep(0.2)
            else:
                continue
            break
        info["returncode"] = self.proc.poll()
        info["seconds"] = round(time.monotonic() - t0, 2)
        # vLLM unlinks its CPU-pool file only on a clean shutdown; remove this server's leftovers:
        # files that appeared while it ran and that no living process maps any more (another
        # engine on the machine keeps its own).
        new = set(glob.glob("/dev/shm/vllm_offload_*")) - self.shm_before
        mapped = mapped_paths() if new else set()
        for path in new - mapped:
            try:
                os.unlink(path)
                info.setdefault("removed_shm", []).append(path)
            except OSError:
                pass
        if new & mapped:
            info["shm_still_mapped"] = sorted(new & mapped)
        return info


def mapped_paths() -> set[str]:
    """/dev/shm paths some living process has mapped (from /proc/*/maps)."""
    out: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                for line in f:
                    i = line.find("/dev/shm/")
                    if i >= 0:
                        out.add(line[i:].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:
            pass
    return out


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stream_completion(port: int, body: dict, timeout_s: float) -> dict:
    """POST /v1/completions with stream=true; TTFT at the first chunk that carries a token."""
    data = json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    t0 = time.perf_counter()
    out: dict = {"chunks": 0, "token_ids": [], "text": "", "top5": None, "usage": None, "finish_reason": None}
    try:
        conn.request(
            "POST",
            "/v1/completions",
            body=data,
            headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        )
        resp = conn.getresponse()
        out["status"] = resp.status
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read()[:2000].decode('utf-8', 'replace')}"
            return out
        deadline = t0 + timeout_s
        while time.perf_counter() < deadline:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                out["done"] = True
                break
            t = time.perf_counter()
            ev = json.loads(payload)
            out["chunks"] += 1
            if ev.get("usage"):
                out["usage"] = ev["usage"]
            for ch in ev.get("choices") or []:
                toks = ch.get("token_ids") or []
                if (toks or ch.get("text")) and "ttft_s" not in out:
                    out["ttft_s"] = t - t0
                out["token_ids"].extend(toks)
                out["text"] += ch.get("text") or ""
                out["finish_reason"] = ch.get("finish_reason") or out["finish_reason"]
                lp = ch.get("logprobs")
                if lp and lp.get("top_logprobs") and out["top5"] is None:
                    first = lp["top_logprobs"][0] or {}
                    out["top5"] = sorted(([k, float(v)] for k, v in first.items()), key=lambda kv: -kv[1])
        else:
            out["error"] = f"stream not finished within {timeout_s} s"
    except Exception as exc:
        out["error"] = repr(exc)
    finally:
        out["total_s"] = time.perf_counter() - t0
        conn.close()
    if "ttft_s" not in out and "error" not in out:
        out["error"] = "no chunk carried a token"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192,16384,32768")
    ap.add_argument("--reps", type=int, default=1, help="prompts per length (distinct prompts)")
    ap.add_argument("--shape", default="32b", choices=sorted(ttft.SHAPES))
    ap.add_argument(
        "--readme", default=os.path.join(REPO, "README.md"), help="where the --kv-transfer-config comes from"
    )
    ap.add_argument(
        "--cpu-bytes",
        type=int,
        default=None,
        help="replace README's cpu_bytes_to_use (the only change made to its JSON; recorded)",
    )
    ap.add_argument("--restarts", type=int, default=1, help="servers started after the first one, same nodes")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--node-capacity", default="20GiB")
    ap.add_argument("--max-value-size", default="64MiB")
    ap.add_argument("--pool-size", type=int, default=16, help="client connections per node (MEMKV_CONFIG pool_size)")
    ap.add_argument("--gpu-util", type=float, default=0.88)
    ap.add_argument(
        "--block-bytes",
        type=int,
        default=None,
        help="bytes of one 64-token block (default: from --shape, 16 MiB for 32b; the dry run's stand-in differs)",
    )
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--logprobs", type=int, default=5, help="top logprobs to compare (0: none)")
    ap.add_argument(
        "--server-cmd",
        default="{python} -m vllm.entrypoints.cli.main serve",
        help="the server command before its arguments ({python}: this interpreter); the dry run uses a stand-in",
    )
    ap.add_argument("--extra-server-args", default="", help="more `vllm serve` arguments")
    ap.add_argument("--server-start-s", type=float, default=300.0, help="bound on one server start (to /health)")
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument("--store-wait-s", type=float, default=60.0, help="bound on waiting for a cold prompt's cascade")
    ap.add_argument("--state-dir", default="/tmp/serve-state")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget; later prompts are skipped")
    args = ap.parse_args()

    t_start = time.time()
    deadline = t_start + args.budget_s
    os.makedirs(args.out_dir, exist_ok=True)
    os.makedirs(args.state_dir, exist_ok=True)
    tokens = [int(x) for x in args.tokens.split(",") if x]
    vocab = ttft.SHAPES[args.shape]["vocab_size"]
    block_bytes = args.block_bytes or ttft.kv_bytes_per_token(args.shape) * BLOCK_TOKENS

    raw = readme_kv_config(args.readme)
    kvc = json.loads(raw)
    kv_arg = (
        raw
        if args.cpu_bytes is None
        else json.dumps(
            {
                **kvc,
                "kv_connector_extra_config": {**kvc["kv_connector_extra_config"], "cpu_bytes_to_use": args.cpu_bytes},
            }
        )
    )
    extra = json.loads(kv_arg)["kv_connector_extra_config"]
    pool = int(extra.get("cpu_bytes_to_use", 0))
    log(
        f"--kv-transfer-config from {os.path.relpath(args.readme, REPO)}"
        f"{'' if args.cpu_bytes is None else f' (cpu_bytes_to_use replaced by {args.cpu_bytes})'}: {' '.join(kv_arg.split())}"
    )
    for L in tokens:
        kv = (L // BLOCK_TOKENS) * block_bytes
        if pool and kv > pool // 2:
            log(
                f"WARNING: a {L}-token prompt is {kv / 2**30:.1f} GiB of KV, more than half of cpu_bytes_to_use "
                f"({pool / 2**30:.1f} GiB): the tier may shed it by design (see --cpu-bytes)"
            )

    doc: dict = {
        "meta": {
            "host": ttft.host_info(),
            "args": vars(args),
            "readme_kv_transfer_config": raw,
            "kv_transfer_config_used": kv_arg,
            "readme_verbatim": args.cpu_bytes is None,
            "block_bytes": block_bytes,
        },
        "servers": [],
        "prompts": [],
        "errors": [],
    }
    out_json = os.path.join(args.out_dir, "serve.json")

    def save() -> None:
        doc["elapsed_s"] = time.time() - t_start
        with open(out_json, "w") as f:
            json.dump(doc, f, indent=1)

    state = ttft.start_nodes(
        args.nodes, args.node_capacity, args.max_value_size, os.path.join(args.state_dir, "nodes"), []
    )
    ports = [n["admin"] for n in state["nodes"]]
    cfg_path = os.path.join(args.state_dir, "client.yaml")
    with open(cfg_path, "w") as f:
        f.write(f"pool_size: {args.pool_size}\nio_timeout_s: 30\n")
    ep_dir = ttft.write_entry_point(os.path.join(args.state_dir, "entry-point"))
    model_dir = ttft.write_model_dir(args.shape, f"/tmp/serve_model_{args.shape}")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # vLLM's own layout
    env.update(
        PYTHONHASHSEED="0",
        VLLM_USE_FLASHINFER_SAMPLER="0",
        VLLM_NO_USAGE_STATS="1",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        MEMKV_SERVERS=",".join(n["address"] for n in state["nodes"]),
        MEMKV_AUTH_KEY=state["key"],
        MEMKV_CONFIG=cfg_path,
        PYTHONPATH=os.pathsep.join(filter(None, [ep_dir, os.environ.get("PYTHONPATH")])),
    )
    port = args.port or free_port()
    served = "memkv-bench"
    argv = [
        *shlex.split(args.server_cmd.format(python=sys.executable)),
        model_dir,
        "--kv-transfer-config",
        kv_arg,
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--max-model-len",
        str(max(tokens) + 64),
        "--gpu-memory-utilization",
        str(args.gpu_util),
        "--seed",
        "0",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        served,
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        *shlex.split(args.extra_server_args),
    ]
    doc["meta"]["server_argv"] = argv
    doc["meta"]["memkv_nodes"] = [n["address"] for n in state["nodes"]]
    log("server: PYTHONHASHSEED=0 " + " ".join(shlex.quote(a) for a in argv))

    def body(ids: list[int]) -> dict:
        b = {
            "model": served,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if args.logprobs:
            b.update(logprobs=args.logprobs, return_tokens_as_token_ids=True)
        return b

    failures: list[str] = []
    server = None
    try:
        for s_idx in range(1 + args.restarts):
            role = "first" if s_idx == 0 else f"restart{s_idx}"
            if time.time() > deadline - 60:
                failures.append(f"{role}: skipped, out of time")
                break
            server = Server(argv, env, os.path.join(args.state_dir, f"server-{role}.log"), port)
            srec: dict = {"role": role}
            doc["servers"].append(srec)
            try:
                srec["start_s"] = server.start(min(args.server_start_s, max(30.0, deadline - time.time() - 30)))
            except Exception as exc:
                srec["error"] = str(exc)
                failures.append(f"{role}: server did not start: {str(exc)[:300]}")
                log(f"[{role}] server did not start:\n{exc}")
                server.stop()
                break
            log(f"[{role}] server healthy after {srec['start_s']:.1f} s (port {port})")
            # Warm-up, not measured (the same ids as ttft.py's warm-up).
            for n in (512, 4096):
                w = stream_completion(port, body(ttft.prompt_ids(n, 424242 + n, vocab)), args.request_timeout_s)
                if w.get("error"):
                    srec.setdefault("warmup_errors", []).append(w["error"])
                    log(f"[{role}] warm-up {n}: {w['error']}")
                    if args.logprobs and w.get("status") == 400:
                        log(f"[{role}] retrying without logprobs")
                        args.logprobs = 0
                        srec["logprobs_disabled"] = w["error"]
                        w = stream_completion(port, body(ttft.prompt_ids(n, 424242 + n, vocab)), args.request_timeout_s)
                        if w.get("error"):
                            srec["warmup_errors"].append(w["error"])
                            log(f"[{role}] warm-up {n} without logprobs: {w['error']}")
            time.sleep(0.5)
            for L in tokens:
                for rep in range(args.reps):
                    if time.time() > deadline - 25:
                        failures.append(f"{role}: {L} tok rep{rep} and later skipped, out of time")
                        raise TimeoutError
                    ids = ttft.prompt_ids(L, ttft.prompt_seed(L, rep), vocab)
                    expected = (L // BLOCK_TOKENS) * block_bytes
                    m0, n0 = server_metrics(port), ttft.node_counters(ports)
                    r = stream_completion(port, body(ids), args.request_timeout_s)
                    n1 = ttft.node_counters(ports)
                    rec = {
                        "server": role,
                        "tokens": L,
                        "rep": rep,
                        "prompt_kv_bytes": expected,
                        "phase": "cold" if s_idx == 0 else "after_restart",
                        **{
                            k: r.get(k)
                            for k in (
                                "ttft_s",
                                "total_s",
                                "token_ids",
                                "text",
                                "top5",
                                "usage",
                                "finish_reason",
                                "chunks",
                                "status",
                                "error",
                            )
                        },
                    }
                    nd = ttft.node_delta(n1, n0)
                    if s_idx == 0:
                        # Cold: wait (bounded) until the cascade put the prompt's blocks on the nodes.
                        d, waited, reached = ttft.wait_nodes(ports, n0, "received", expected, args.store_wait_s)
                        rec["store_wait"] = {"received": d["received"], "seconds": round(waited, 3), "reached": reached}
                        if not reached:
                            failures.append(
                                f"STORE {role} {L} tok rep{rep}: nodes received {d['received'] / 2**30:.3f} "
                                f"of {expected / 2**30:.3f} GiB in {waited:.1f} s"
                            )
                    elif nd["sent"] < expected and not nd["errors"]:
                        nd, _, _ = ttft.wait_nodes(ports, n0, "sent", expected, 2.0, quiet_s=1.0)
                    rec["nodes"] = nd
                    rec["memkv_sent_bytes"] = nd["sent"]
                    # The server's counters: the stats of the steps around the request, give them a moment.
                    m1 = server_metrics(port)
                    if s_idx > 0:
                        t_m = time.monotonic()
                        while server_load_bytes(metric_diff(m1, m0)) < expected and time.monotonic() - t_m < 5.0:
                            time.sleep(0.25)
                            m1 = server_metrics(port)
                    rec["server_metrics"] = metric_diff(m1, m0)
                    if "_error" in m1:
                        rec["server_metrics_error"] = m1["_error"]
                    rec["server_memkv_load_bytes"] = server_load_bytes(rec["server_metrics"])
                    if r.get("error"):
                        failures.append(f"REQUEST {role} {L} tok rep{rep}: {r['error'][:500]}")
                    if s_idx > 0:
                        rec["origin_ok"] = nd["sent"] >= expected and not nd["errors"]
                        rec["server_metric_ok"] = rec["server_memkv_load_bytes"] >= expected
                        if not rec["origin_ok"]:
                            failures.append(
                                f"ORIGIN {role} {L} tok rep{rep}: nodes sent {nd['sent'] / 2**30:.3f} GiB of "
                                f"{expected / 2**30:.3f} GiB; node errors {nd['errors']}"
                            )
                        if not rec["server_metric_ok"]:
                            failures.append(
                                f"SERVER METRIC {role} {L} tok rep{rep}: vllm:kv_offload_memkv_load_bytes "
                                f"grew by {rec['server_memkv_load_bytes'] / 2**30:.3f} GiB, prompt KV "
                                f"{expected / 2**30:.3f} GiB"
                            )
                    doc["prompts"].append(rec)
                    cached = (r.get("usage") or {}).get("prompt_tokens_details") or {}
                    log(
                        f"[{role}] {L:>6} tok rep{rep}: TTFT {r.get('ttft_s', float('nan')):.3f} s  tok={r.get('token_ids')} "
                        f"cached={cached.get('cached_tokens')} nodes_sent={nd['sent'] / 2**30:.2f} GiB "
                        f"server_memkv_load={rec['server_memkv_load_bytes'] / 2**30:.2f} GiB of {expected / 2**30:.2f}"
                        + (f"  ERROR {r['error'][:200]}" if r.get("error") else "")
                    )
                    save()
            srec["final_metrics"] = server_metrics(port)
            srec["stop"] = server.stop()
            log(f"[{role}] server stopped: {srec['stop']}")
            server = None
            save()
    except TimeoutError:
        pass
    except Exception as exc:
        import traceback

        failures.append(f"serve.py: {exc!r}")
        doc["errors"].append(traceback.format_exc())
        log(traceback.format_exc())
    finally:
        if server is not None:
            doc["servers"][-1]["stop"] = server.stop()
        doc["meta"]["node_status"] = ttft.node_status(state)
        ttft.stop_nodes(state)
        for s in doc["servers"]:  # the server logs travel back: their tails in the JSON, the files beside it
            path = os.path.join(args.state_dir, f"server-{s['role']}.log")
            try:
                with open(path, errors="replace") as f:
                    s["log_tail"] = f.read()[-20000:]
                shutil.copy(path, os.path.join(args.out_dir, f"serve-server-{s['role']}.log"))
            except OSError:
                pass

    # Output identical across servers, per prompt.
    by: dict = {}
    for p in doc["prompts"]:
        by.setdefault((p["tokens"], p["rep"]), []).append(p)
    for (L, rep), ps in sorted(by.items()):
        toks = {json.dumps(p["token_ids"]) for p in ps}
        if len(toks) > 1:
            failures.append(f"OUTPUT {L} tok rep{rep}: {[(p['server'], p['token_ids']) for p in ps]}")
        t5 = {json.dumps(p["top5"]) for p in ps if p.get("top5") is not None}
        for p in ps:
            p["top5_distinct"] = len(t5)
    doc["failures"] = failures
    save()

    print()
    print(
        "| tokens | KV bytes | cold TTFT | TTFT after restart | MemKV bytes served (nodes) | "
        "vllm:kv_offload_memkv_load_bytes | cached tokens | output |"
    )
    print("|---:|---:|---|---|---|---|---|---|")
    for (L, _rep), ps in sorted(by.items()):
        cold = [p for p in ps if p["phase"] == "cold"]
        rs = [p for p in ps if p["phase"] != "cold"]

        def f(x):
            return (
                " / ".join(f"{p['ttft_s']:.3f}" if p.get("ttft_s") is not None else "-" for p in x) + " s" if x else "-"
            )

        served_b = " / ".join(f"{p['memkv_sent_bytes'] / 2**30:.2f}" for p in rs) + " GiB" if rs else "-"
        srv_b = " / ".join(f"{p['server_memkv_load_bytes'] / 2**30:.2f}" for p in rs) + " GiB" if rs else "-"
        cached = " / ".join(
            str(((p.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")) for p in ps
        )
        same = "identical" if len({json.dumps(p["token_ids"]) for p in ps}) == 1 else "DIFFERS"
        print(
            f"| {L:,} | {ps[0]['prompt_kv_bytes'] / 2**30:.2f} GiB | {f(cold)} | {f(rs)} | {served_b} | {srv_b} | {cached} | {same} |"
        )
    if failures:
        print("\nFAILURES:")
        for x in failures:
            print("  ", x)
    else:
        print("\nevery revisit after a restart was served whole by MemKV; greedy output identical")
    print(f"wrote {out_json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
