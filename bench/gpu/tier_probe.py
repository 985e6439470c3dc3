"""Timestamps of a promotion's stages, taken by wrapping the live MemKV (or fs) tier's methods.

Two ways in, the same events:
  * in-process engine core (ttft.py --inproc): ttft.py wraps the tier object it finds;
  * vLLM's default layout (engine core in its own process, as `vllm serve` runs it): ttft.py
    adds the entry point `ttft_probe = tier_probe:install_plugin` to the `vllm.general_plugins`
    group of the dist-info it writes. vLLM loads it in every process it starts; in the engine
    core it wraps each `MemKVSecondaryTierManager` when it is built, and the events go, one JSON
    line each, to the file named by TTFT_PROBE_FILE. ttft.py reads the lines a run appended.
Times are wall-clock (`time.time()`): both processes are on one host.

Benchmark instrumentation only: nothing in src/ knows about it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import ClassVar

ENV_FILE = "TTFT_PROBE_FILE"
# bench/gpu/direct.py, engine core in its own process: direct mode's stage times (the
# memkv_vllm.direct.timing logger, DEBUG) go to this file, one JSON line [msg, args] per record.
ENV_DIRECT_TIMING = "DIRECT_TIMING_FILE"
ENV_PHASES = "TTFT_PROBE_PHASES"  # "1": also time the client's load-path calls (LoaderPhases)
# "1": before a load task receives into its rows, populate their page tables for writing
# (madvise MADV_POPULATE_WRITE; the bytes are not touched). A diagnostic of whether the rows'
# first writes in this process (page faults) are what makes a restarted engine's loads slower.
ENV_PREFAULT = "TTFT_PROBE_PREFAULT"
MADV_POPULATE_WRITE = 23  # Linux 5.14+


def rusage_now() -> tuple:
    """This process's page faults, context switches and CPU seconds so far."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return (r.ru_minflt, r.ru_majflt, r.ru_nvcsw, r.ru_nivcsw, r.ru_utime + r.ru_stime)


class RowPrefaulter:
    """Wraps a tier client's batch_load_into: MADV_POPULATE_WRITE over each destination view
    first (page-aligned), so the receive copies find the page tables populated."""

    def __init__(self, client) -> None:
        import ctypes
        import mmap

        from memkv.nixl_adapter import buffer_address

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.failures = 0
        real = client.batch_load_into

        def batch_load_into(pairs, *args, **kwargs):
            for _key, view in pairs:
                addr = buffer_address(view)
                lo = addr - addr % mmap.PAGESIZE
                if libc.madvise(lo, addr + len(view) - lo, MADV_POPULATE_WRITE) != 0:
                    if not self.failures:
                        print(f"probe: MADV_POPULATE_WRITE failed: errno {ctypes.get_errno()}", flush=True)
                    self.failures += 1
            return real(pairs, *args, **kwargs)

        client.batch_load_into = batch_load_into


class LoaderPhases:
    """Times the MemKV client's load-path calls, in whatever process loads: each call gives
    `sink((time, "phase", name, seconds))`. Used by bench/busy_scheduler.py --breakdown and, in
    the engine core, by the probe plugin when TTFT_PROBE_PHASES=1."""

    PHASES: ClassVar[dict[tuple[str, str, str], str]] = {  # (module, class, method): phase name
        ("memkv.transport.rdma", "RdmaTransport", "_load_chunk"): "rdma load (whole chunk)",
        ("memkv.transport.tcp", "TcpTransport", "get_into"): "tcp load (whole call)",
        ("memkv.integrity", "Checksummer", "verify"): "verify",
        ("memkv.client.node", "NodeConnection", "read_reply"): "read reply",
        ("memkv.client.node", "NodeConnection", "send"): "send request",
        ("memkv.client.node", "NodeClient", "borrow"): "borrow a connection",
        ("memkv.transport.rdma", "RdmaTransport", "_attach"): "rdma attach",
        ("memkv.transport.rdma", "_NotifInbox", "wait"): "notification wait",
    }

    def __init__(self, sink) -> None:
        self._sink = sink
        self._undo: list[tuple[object, str, object]] = []

    def install(self) -> None:
        import functools
        import importlib

        for (mod, cls, attr), phase in self.PHASES.items():
            owner = getattr(importlib.import_module(mod), cls, None)
            real = getattr(owner, attr, None)
            if real is None:  # a client without that call: the phase is not timed
                continue

            def timed(*args, _real=real, _phase=phase, **kwargs):
                t = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    self._sink((time.time(), "phase", _phase, time.perf_counter() - t))

            setattr(owner, attr, functools.wraps(real)(timed))
            self._undo.append((owner, attr, real))

    def uninstall(self) -> None:
        for owner, attr, real in reversed(self._undo):
            setattr(owner, attr, real)
        self._undo.clear()


class TierProbe:
    """Wraps lookup, the exists probe (memkv), submit_load, the transfer pool's finished jobs and
    get_finished_jobs; `events` holds (time, name, ...) tuples, or `sink` gets each one."""

    def __init__(self, tier, kind: str, sink=None) -> None:
        self.tier = tier
        self.kind = kind
        self.events: list[tuple] = []
        self._sink = sink
        self._lock = threading.Lock()
        self._first_lookup = None
        self._requests_seen: set = set()  # file mode: a first_lookup per request (no reset() there)
        self.installed: list[str] = []
        self._install()

    def ev(self, *e) -> None:
        rec = (time.time(), *e)
        with self._lock:
            if self._sink is not None:
                self._sink(rec)
            else:
                self.events.append(rec)

    def reset(self) -> None:
        with self._lock:
            self.events = []
        self._first_lookup = None

    def _wrap(self, obj, name: str, label: str, make) -> None:
        try:
            setattr(obj, name, make(getattr(obj, name)))
            self.installed.append(label)
        except Exception as exc:  # a release without the attribute: that stage is not timed
            print(f"probe: {label} wrapper failed: {exc!r}", flush=True)

    def _install(self) -> None:
        def lookup(orig):
            def wrapped(key, req_context):
                rid = getattr(req_context, "req_id", None)
                if self._sink is not None and rid not in self._requests_seen:
                    self._requests_seen.add(rid)
                    self.ev("first_lookup", rid)
                elif self._sink is None and self._first_lookup is None:
                    self._first_lookup = time.time()
                    self.ev("first_lookup")
                return orig(key, req_context)

            return wrapped

        def submit_load(orig):
            def wrapped(job):
                self.ev("submit_load", len(job.keys))
                self.ev("rusage", *rusage_now())
                return orig(job)

            return wrapped

        def get_finished_jobs(orig):
            def wrapped():
                res = list(orig())
                for r in res:
                    self.ev(
                        "job_taken",
                        getattr(r, "job_id", None),
                        bool(getattr(r, "success", True)),
                        getattr(r, "transfer_time", None),
                        getattr(r, "transfer_bytes", None),
                    )
                return res

            return wrapped

        self._wrap(self.tier, "lookup", "lookup", lookup)
        self._wrap(self.tier, "submit_load", "submit_load", submit_load)
        self._wrap(self.tier, "get_finished_jobs", "get_finished_jobs", get_finished_jobs)
        if self.kind == "memkv":

            def submit(orig):  # one batch of lookup keys goes to the prober (EXISTS pipeline)
                def wrapped(batch):
                    self.ev("exists_submit", len(batch))
                    return orig(batch)

                return wrapped

            def answered(orig):  # answers come back in parts, on the prober's thread
                def wrapped(rnd, indices, hits):
                    self.ev("exists_answer", len(indices), int(sum(bool(h) for h in hits)))
                    return orig(rnd, indices, hits)

                return wrapped

            self._wrap(self.tier._lookup, "_submit", "exists_submit", submit)
            self._wrap(self.tier._lookup, "_answered", "exists_answer", answered)
            self.wrap_pool(self.tier._pool)

    def wrap_pool(self, pool) -> None:
        def take_finished(orig):
            def wrapped():
                fins = orig()
                for f in fins:
                    self.ev("job_done", f.kind, f.seconds, len(f.keys), int(sum(f.ok)))
                if any(f.kind == "load" for f in fins):
                    self.ev("rusage", *rusage_now())
                return fins

            return wrapped

        self._wrap(pool, "take_finished", "pool", take_finished)

    def timeline(self, t0: float, t1: float) -> dict:
        with self._lock:
            evs = list(self.events)
        return timeline(evs, t0, t1)


class FileProbe:
    """The engine-core side's events, read back from TTFT_PROBE_FILE by the engine's driver:
    `reset()` marks the file's end, `timeline()` reads what was appended since."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.installed = ["file:" + path]
        self._offset = 0

    def reset(self) -> None:
        self._offset = os.path.getsize(self.path) if os.path.exists(self.path) else 0

    def timeline(self, t0: float, t1: float) -> dict:
        evs = []
        if os.path.exists(self.path):
            with open(self.path) as f:
                f.seek(self._offset)
                for line in f:
                    if line.endswith("\n"):
                        evs.append(tuple(json.loads(line)))
        return timeline(evs, t0, t1)


def timeline(evs: list[tuple], t0: float, t1: float) -> dict:
    """Stages of the run that started at t0 and returned at t1 (seconds from t0)."""
    evs = [e for e in evs if e[0] >= t0 - 1e-3]
    out: dict = {"total_s": t1 - t0}
    first = [e for e in evs if e[1] == "first_lookup"]
    if first:
        out["first_lookup_s"] = first[0][0] - t0
    sent = [e for e in evs if e[1] == "exists_submit"]
    answers = [e for e in evs if e[1] == "exists_answer"]
    if sent:
        out["exists_rounds"] = len(sent)
        out["exists_keys"] = sum(e[2] for e in sent)
        out["exists_hits"] = sum(e[3] for e in answers)
    if answers:
        out["last_exists_end_s"] = answers[-1][0] - t0
    subs = [e for e in evs if e[1] == "submit_load"]
    if subs:
        out["load_jobs"] = len(subs)
        out["load_blocks"] = sum(e[2] for e in subs)
        out["first_submit_load_s"] = subs[0][0] - t0
        out["last_submit_load_s"] = subs[-1][0] - t0
    done = [e for e in evs if e[1] == "job_done" and e[2] == "load"]
    if done:
        out["load_job_s"] = [round(e[3], 6) for e in done]
        out["load_done_s"] = max(e[0] for e in done) - t0  # when the tier handed it over
        out["load_job_blocks_ok"] = sum(e[5] for e in done)
    usage = [e for e in evs if e[1] == "rusage" and e[0] <= t1 + 1e-3]
    if len(usage) >= 2:  # the engine core's own counters from the first submit to the last load done
        a, b = usage[0], usage[-1]
        out["engine_core_during_load"] = {
            "minflt": b[2] - a[2],
            "majflt": b[3] - a[3],
            "nvcsw": b[4] - a[4],
            "nivcsw": b[5] - a[5],
            "cpu_s": round(b[6] - a[6], 4),
        }
    phases = [e for e in evs if e[1] == "phase" and e[0] <= t1 + 1e-3]
    if phases:  # LoaderPhases (TTFT_PROBE_PHASES=1): seconds summed over the loader threads
        agg: dict = {}
        for e in phases:
            a = agg.setdefault(e[2], {"seconds": 0.0, "calls": 0})
            a["seconds"] += e[3]
            a["calls"] += 1
        out["loader_phases"] = {
            k: {"seconds": round(v["seconds"], 4), "calls": v["calls"]} for k, v in sorted(agg.items())
        }
    taken = [e for e in evs if e[1] == "job_taken"]
    if taken:
        out["jobs_taken"] = len(taken)
        out["last_job_taken_s"] = taken[-1][0] - t0
        tt = [e[4] for e in taken if e[4] is not None]
        if tt:
            out["job_transfer_time_s"] = [round(x, 6) for x in tt]
    return out


def stages(tl: dict) -> dict:
    """The three stages the issue asks for, from one run's timeline (seconds, None if unseen):
    lookup = first lookup -> promotion submitted; memkv_to_pool = submitted -> the tier's last
    load job done; pool_to_gpu_token = the manager took the job -> generate() returned."""

    def get(k):
        return tl.get(k)

    lookup = memkv = rest = None
    if get("first_lookup_s") is not None and get("first_submit_load_s") is not None:
        lookup = get("first_submit_load_s") - get("first_lookup_s")
    if get("first_submit_load_s") is not None and get("load_done_s") is not None:
        memkv = get("load_done_s") - get("first_submit_load_s")
    if get("last_job_taken_s") is not None:
        rest = tl["total_s"] - get("last_job_taken_s")
    return {"lookup_s": lookup, "memkv_to_pool_s": memkv, "pool_to_gpu_token_s": rest}


class JsonLinesHandler(logging.Handler):
    """Writes [msg, args] per record, one JSON line each, with one write to a file opened for
    appending (the records of several processes interleave whole lines)."""

    def __init__(self, path: str) -> None:
        super().__init__(logging.DEBUG)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, record: logging.LogRecord) -> None:
        os.write(self.fd, (json.dumps([str(record.msg), list(record.args or ())], default=str) + "\n").encode())


def install_direct_timing(path: str) -> None:
    """Direct mode's timing records (DEBUG) of this process to `path` (once per process)."""
    timing = logging.getLogger("memkv_vllm.direct.timing")
    if not any(isinstance(h, JsonLinesHandler) for h in timing.handlers):
        timing.addHandler(JsonLinesHandler(path))
        timing.setLevel(logging.DEBUG)


def install_plugin() -> None:
    """vLLM general plugin (every vLLM process): wrap each MemKV tier built in this process;
    with DIRECT_TIMING_FILE set, write direct mode's timing records there."""
    if os.environ.get(ENV_DIRECT_TIMING):
        install_direct_timing(os.environ[ENV_DIRECT_TIMING])
    path = os.environ.get(ENV_FILE)
    if not path:
        return
    try:
        from memkv_vllm.tier import MemKVSecondaryTierManager
    except Exception as exc:  # not a process that builds tiers, or the tier is absent
        print(f"probe plugin: no tier class ({exc!r})", flush=True)
        return
    if getattr(MemKVSecondaryTierManager, "_ttft_probed", False):
        return
    lock = threading.Lock()
    out = open(path, "a", buffering=1)  # noqa: SIM115 (held open for the process's lifetime: the sink writes to it)

    def sink(rec: tuple) -> None:
        with lock:
            out.write(json.dumps(rec) + "\n")

    orig_init = MemKVSecondaryTierManager.__init__

    def init(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        TierProbe(self, "memkv", sink=sink)
        sink((time.time(), "probe_installed", os.getpid()))
        if os.environ.get(ENV_PREFAULT) == "1":
            RowPrefaulter(self.client)
            sink((time.time(), "prefault_installed", os.getpid()))

    MemKVSecondaryTierManager.__init__ = init
    MemKVSecondaryTierManager._ttft_probed = True
    if os.environ.get(ENV_PHASES) == "1":
        LoaderPhases(sink).install()
