"""The scheduler's side of vLLM's OffloadingConnector, reduced to what decides whether requests
run, driven against vLLM's real TieringOffloadingManager (needs vLLM: import after importorskip).

`Scheduler(engine)` keeps a set of waiting requests. One `step()` is, as in
`vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py`:

1. under the manager lock, each waiting request looks its chunks up in order, as
   `_maximal_prefix_lookup` does: HIT and HIT_PENDING count, RETRY defers the request (the scan
   goes on to start probes), MISS ends the prefix. A request that is not deferred is scheduled:
   `prepare_load` for its hit prefix in the same step; then `on_schedule_end`;
2. outside the lock (the "model execution" window), the scheduled requests' rows are read back and
   compared byte for byte with what was stored, then `complete_load` and `on_request_finished`.

A request is *resolved* at the step its lookup stops deferring; its resolution time runs from the
step of its first lookup. `run()` steps until every request is resolved or a step count or
wall-clock bound is reached, whichever comes first, and never raises on the bounds.

`client_config(tmp_path, ...)` writes the client.yaml that sets the tier's client timeouts (they
have no environment variables); `point_tier_at(monkeypatch, addresses, key_hex, config)` sets
MEMKV_SERVERS / MEMKV_AUTH_KEY / MEMKV_CONFIG and registers the tier.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence

import yaml

from tests.conformance import vllm_harness as h

LookupResult = h.LookupResult
_pause = threading.Event()  # never set: wait() is a bounded pause


@dataclasses.dataclass
class SimRequest:
    req: object
    keys: list
    first_lookup: float | None = None
    resolved_at: float | None = None
    hits: int = 0
    answers: set = dataclasses.field(default_factory=set)
    bytes_ok: bool | None = None  # None until loaded; True when every loaded row matched

    @property
    def resolution_s(self) -> float | None:
        if self.resolved_at is None or self.first_lookup is None:
            return None
        return self.resolved_at - self.first_lookup


class Scheduler:
    def __init__(self, engine: h.HeadlessEngine, expected: dict, step_s: float = 0.01) -> None:
        self.engine = engine
        self.expected = expected  # key -> the bytes that were stored under it
        self.step_s = step_s
        self.waiting: list[SimRequest] = []
        self.done: list[SimRequest] = []
        self.steps = 0
        self.step_starts: list[float] = []
        self.mismatches: list[str] = []
        self._ids = itertools.count()

    def submit(self, keys: Sequence) -> SimRequest:
        req = self.engine.new_request(f"sim-{next(self._ids)}")
        sim = SimRequest(req, list(keys))
        self.waiting.append(sim)
        return sim

    def _prefix_lookup(self, sim: SimRequest) -> int | None:
        manager = self.engine.manager
        hits, defer = 0, False
        for key in sim.keys:
            result = manager.lookup(key, sim.req)
            sim.answers.add(result)
            if result in (LookupResult.HIT, LookupResult.HIT_PENDING):
                hits += 1
                defer |= result is LookupResult.HIT_PENDING
            elif result is LookupResult.RETRY:
                defer = True
            else:
                break
        return None if defer else hits

    def step(self) -> list[SimRequest]:
        now = time.monotonic()
        self.step_starts.append(now)
        self.steps += 1
        scheduled: list[tuple[SimRequest, list[int]]] = []
        with self.engine.lock:
            for sim in list(self.waiting):
                if sim.first_lookup is None:
                    sim.first_lookup = now
                hits = self._prefix_lookup(sim)
                if hits is None:
                    continue
                sim.resolved_at = now
                sim.hits = hits
                self.waiting.remove(sim)
                rows = []
                if hits:
                    rows = h.row_ids(self.engine.manager.prepare_load(sim.keys[:hits], sim.req))
                scheduled.append((sim, rows))
            self.engine.end_step_locked()
        for sim, rows in scheduled:  # the "model execution" window: rows go to the GPU here
            ok = True
            for key, row in zip(sim.keys, rows):
                if self.engine.read_row(row) != self.expected[key]:
                    ok = False
                    self.mismatches.append(
                        f"{sim.req.req_id}: row {row} differs from what was stored for {key.hex()[:16]}"
                    )
            sim.bytes_ok = ok
            with self.engine.lock:
                if rows:
                    self.engine.manager.complete_load(sim.keys[: sim.hits], sim.req)
                self.engine.manager.on_request_finished(sim.req)
            self.done.append(sim)
        return [sim for sim, _ in scheduled]

    def run(
        self,
        max_s: float,
        max_steps: int = 100_000,
        until_resolved: bool = True,
        until: Callable[[], bool] | None = None,
    ) -> float:
        """Step every `step_s` until every request resolved (if `until_resolved`), `until()` is
        true (if given), `max_s` passed or `max_steps` were taken. Returns the seconds spent."""
        started = time.monotonic()
        for _ in range(max_steps):
            if until_resolved and not self.waiting:
                break
            if until is not None and until():
                break
            if time.monotonic() - started >= max_s:
                break
            self.step()
            _pause.wait(self.step_s)
        return time.monotonic() - started

    def worst_step_gap(self) -> float:
        """The longest time between two consecutive step starts: "one step" in the bounds."""
        gaps = [b - a for a, b in zip(self.step_starts, self.step_starts[1:])]
        return max(gaps, default=self.step_s)


def client_config(
    tmp_path, *, io_timeout_s: float, connect_timeout_s: float = 1.0, down_for_s: float = 0.5, pool_size: int = 8
) -> str:
    path = tmp_path / f"client-{io_timeout_s}-{down_for_s}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "io_timeout_s": io_timeout_s,
                "connect_timeout_s": connect_timeout_s,
                "down_for_s": down_for_s,
                "pool_size": pool_size,
            }
        )
    )
    return str(path)


def point_tier_at(
    monkeypatch, addresses: Sequence[str], key_hex: str, config_path: str | None = None, tls=None
) -> None:
    """The tier's environment, as a user sets it; `tls` (a ClientTls: a TLS node's
    `client_tls`) sets MEMKV_TLS_CA."""
    import memkv_vllm

    monkeypatch.setenv("MEMKV_SERVERS", ",".join(addresses))
    monkeypatch.setenv("MEMKV_AUTH_KEY", key_hex)
    if config_path:
        monkeypatch.setenv("MEMKV_CONFIG", config_path)
    else:
        monkeypatch.delenv("MEMKV_CONFIG", raising=False)
    for var in (
        "MEMKV_LICENSE",
        "MEMKV_TRANSPORT",
        "MEMKV_TLS_CA",
        "MEMKV_TLS_CERT",
        "MEMKV_TLS_KEY",
        "MEMKV_TLS_SERVER_NAME",
    ):
        monkeypatch.delenv(var, raising=False)
    if tls is not None:
        monkeypatch.setenv("MEMKV_TLS_CA", tls.ca)
    memkv_vllm.register()


def memkv_tier(**overrides) -> dict:
    return {"type": "memkv", "n_read_threads": 4, "n_write_threads": 2, **overrides}


def tier_of(engine: h.HeadlessEngine):
    (tier,) = engine.manager.secondary_tiers
    return tier


def store_all(engine: h.HeadlessEngine, keys: Sequence, per_request: int = 16, timeout_s: float = 30.0) -> dict:
    """Cascade `keys` into the secondary tier (in batches that fit the pool); returns key -> bytes."""
    payloads = {}
    for i in range(0, len(keys), per_request):
        req = engine.new_request()
        out = engine.store_chunks(req, keys[i : i + per_request])
        payloads.update({k: engine.payloads[k] for k in out.rows})
        engine.finish_request(req)
        engine.step()
        engine.run_until_idle(timeout_s=timeout_s)
    return payloads


def corpus(monkeypatch, nodes, key_hex: str, per_node: int, geometry: h.Geometry, addresses=None):
    """Chunks stored through a writer engine, `per_node` owned by each of two nodes. Returns
    (keys owned by nodes[0], keys owned by nodes[1], key -> stored bytes). `addresses` are what
    the tier is pointed at (proxies in front of `nodes`), in the same order."""
    (a, b), payloads = corpus_by_node(monkeypatch, nodes, key_hex, per_node, geometry, addresses)
    return a, b, payloads


def corpus_by_node(monkeypatch, nodes, key_hex: str, per_node: int, geometry: h.Geometry, addresses=None):
    """`corpus` for any number of nodes: ([keys owned by each node, in node order], key -> stored bytes)."""
    names = list(addresses or [n.address for n in nodes])
    point_tier_at(monkeypatch, names, key_hex)
    candidates = per_node * 4 * len(names)
    with h.HeadlessEngine([memkv_tier()], geometry) as writer:
        tier = tier_of(writer)
        by_owner: dict[str, list] = {name: [] for name in names}
        for key in h.make_keys(candidates):
            bucket = by_owner[tier.client.owner(tier.namespace.key(key)).name]
            if len(bucket) < per_node:
                bucket.append(key)
        owned = [by_owner[name] for name in names]
        assert all(len(keys) == per_node for keys in owned), f"not {per_node} keys per node in {candidates} candidates"
        payloads = store_all(writer, [k for keys in owned for k in keys])
    return owned, payloads


def submit_wave(sched: Scheduler, a_keys, b_keys, n_requests: int, chunks: int) -> tuple[list, list]:
    """n_requests / 2 requests whose chunks live on the first node, as many on the second."""
    half = n_requests // 2
    on_a = [sched.submit(a_keys[i * chunks : (i + 1) * chunks]) for i in range(half)]
    on_b = [sched.submit(b_keys[i * chunks : (i + 1) * chunks]) for i in range(half)]
    return on_a, on_b


def assert_resolved_within(sched: Scheduler, wave, bound_s: float, what: str) -> float:
    """Every request of `wave` resolved, none later than `bound_s`, no row mismatched; returns
    the worst resolution time."""
    unresolved = [s.req.req_id for s in wave if s.resolved_at is None]
    assert not unresolved, f"{what}: {len(unresolved)} requests still deferred: {unresolved[:4]}"
    worst = max(s.resolution_s for s in wave)
    assert worst <= bound_s, f"{what}: a request took {worst:.3f}s to resolve (bound {bound_s:.3f}s)"
    assert not sched.mismatches, sched.mismatches[:3]
    return worst
