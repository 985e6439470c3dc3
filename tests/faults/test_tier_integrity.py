"""Nothing corrupted through vLLM: every promotion that succeeds is byte-exact, under faults.

Behaviour under test, with vLLM's real TieringOffloadingManager and the memkv tier talking to a
real node through a fault-injecting proxy (tests/faults/proxy.py):

* round after round, chunks cascade into MemKV, the CPU pool is reset, and requests look them up
  and promote them (tier_sim.Scheduler), while the proxy flips value, header, MAC and meta bytes,
  truncates and resets connections mid-value, stalls replies past the client timeout, trickles
  them, and SIGKILLs the node mid-transfer (it restarts empty on the same port). Every promoted
  row is compared byte for byte with what was stored: not one differs; the rest are misses;
* a byte flipped in a stored value (on its way into MemKV) is caught by the checksum when it is
  promoted: the promotion fails, the block is a miss, the key is purged from MemKV, and the
  failure is counted (`memkv_client_integrity_failures`, `vllm:kv_offload_memkv_jobs_failed`).

Bounded by a round count and a wall-clock budget, both scaled by MEMKV_FAULT_SCALE.
"""

from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.factory", reason="tier fault tests need vLLM (run them in a nox venv)")

from tests.conformance import vllm_harness as h
from tests.conftest import poll_until
from tests.faults import tier_sim as ts
from tests.faults.figures import scaled, scaled_s
from tests.faults.nodeops import NO_LOCAL_SOCKET, NodeKiller, integrity_failures, start_on_port
from tests.faults.proxy import C2S, Fault, FaultProxy, FlipNextPut, RandomFaults

pytestmark = [pytest.mark.faults, pytest.mark.conformance]  # conformance: runs in each nox vLLM session

IO_TIMEOUT_S = 0.5
GEOMETRY = h.Geometry(worker_kv_bytes_per_block=64 << 10, num_rows=32)  # 128 KiB rows
LookupResult = h.LookupResult


def test_promotions_under_fault_injection_are_byte_exact_or_a_miss(
    monkeypatch, start_node, auth_key_hex, tmp_path, figures
):
    rounds = scaled(40)
    budget_s = scaled_s(20.0)
    node = start_node(capacity="256MiB", extra_args=["--admin-port", "0", NO_LOCAL_SOCKET])
    port = node.port
    killer = NodeKiller(node)
    faults = RandomFaults(seed=21, rate=0.1, io_timeout_s=IO_TIMEOUT_S, header_rate=0.02)
    rng = random.Random(22)
    max_kills = scaled(2)

    def plan(frame):
        if frame.payload_len and killer.kills < max_kills and not killer.fired.is_set() and rng.random() < 0.01:
            return Fault.call(frame.payload_start + frame.payload_len // 2, killer)
        return faults(frame)

    proxy = FaultProxy((node.host, port), name="tier-integrity")
    config = ts.client_config(tmp_path, io_timeout_s=IO_TIMEOUT_S, connect_timeout_s=IO_TIMEOUT_S, down_for_s=0.05)
    ts.point_tier_at(monkeypatch, [proxy.address], auth_key_hex, config)
    promotions = checked = misses = restarts = 0
    mismatches: list[str] = []
    integrity_before = integrity_failures()
    started = time.monotonic()
    try:
        with h.HeadlessEngine([ts.memkv_tier(lookup_timeout_s=2.0, blocks_per_op=2)], GEOMETRY) as engine:
            proxy.plan = plan  # faults from here on: the tier's startup probe went through clean
            sched = ts.Scheduler(engine, {}, step_s=0.005)
            for _ in range(rounds):
                if time.monotonic() - started > budget_s:
                    break
                if killer.fired.is_set():
                    killer.node.proc.wait(10)
                    fresh = start_on_port(auth_key_hex, port, capacity="256MiB", extra_args=[NO_LOCAL_SOCKET])
                    start_node.nodes.append(fresh)
                    killer.node = fresh
                    restarts += 1
                    killer.fired.clear()
                # After a fault the client skips the node for down_for_s (misses, no I/O): let the
                # mark expire before each phase, so that every round really crosses the proxy.
                up = lambda: all(n["up"] for n in ts.tier_of(engine).client.health())  # noqa: E731
                poll_until(up, 5.0, what="the down mark to expire")
                keys = h.make_keys(8)
                sched.expected.update(ts.store_all(engine, keys, per_request=8, timeout_s=30))
                engine.reset_cache()  # the pool forgets them: lookups must go to MemKV
                poll_until(up, 5.0, what="the down mark to expire")
                wave = [sched.submit(keys[i : i + 2]) for i in range(0, 8, 2)]
                sched.run(30)
                for sim in wave:
                    assert sim.resolved_at is not None, "a request never resolved"
                    promotions += len(sim.keys)
                    checked += sim.hits
                    misses += len(sim.keys) - sim.hits
                mismatches += sched.mismatches
                sched.mismatches.clear()
            counts = proxy.counts()
            stored_flips = [a for a in proxy.applied if a.fault.kind == "flip" and a.frame.direction == C2S and a.keys]
    finally:
        proxy.close()
    took = time.monotonic() - started
    caught = integrity_failures() - integrity_before
    assert not mismatches, f"{len(mismatches)} promotions succeeded with wrong bytes: {mismatches[:3]}"
    assert checked > 0 and sum(counts.values()) > 0
    figures(
        tier_promotions=promotions,
        tier_promotions_checked_byte_exact=checked,
        tier_misses=misses,
        tier_mismatches=len(mismatches),
        faults=counts,
        node_kills=killer.kills,
        node_restarts=restarts,
        stored_value_flips=len(stored_flips),
        integrity_failures_caught=int(caught),
        seconds=round(took, 1),
    )


@pytest.mark.over_tls_too  # [tls]: a TLS-only node, the proxy re-encrypting the flipped byte
def test_flipped_byte_in_a_stored_value_is_a_miss_and_is_purged(
    monkeypatch, start_node, auth_key_hex, tmp_path, figures
):
    node = start_node(capacity="64MiB", extra_args=[NO_LOCAL_SOCKET])
    plan = FlipNextPut(offset=1000)  # a byte of the frame's first value

    with FaultProxy((node.host, node.port), plan, name="flip", tls=node.client_tls is not None) as proxy:
        ts.point_tier_at(monkeypatch, [proxy.address], auth_key_hex, tls=node.client_tls)
        with h.HeadlessEngine([ts.memkv_tier(blocks_per_op=1)], h.Geometry(num_rows=16)) as engine:
            tier = ts.tier_of(engine)
            corrupt, clean = h.make_keys(2)
            plan.arm()
            payloads = ts.store_all(engine, [corrupt])  # its bytes are flipped on the way in
            payloads.update(ts.store_all(engine, [clean]))
            (applied,) = proxy.applied
            assert applied.keys == (tier.namespace.key(corrupt),), applied
            assert tier.client.exists(tier.namespace.keys([corrupt, clean])) == [True, True]
            engine.reset_cache()
            integrity_before = integrity_failures()
            failed_before = tier.stats.total("vllm:kv_offload_memkv_jobs_failed", ("load",))

            sched = ts.Scheduler(engine, payloads)
            bad, good = sched.submit([corrupt]), sched.submit([clean])
            sched.run(20)
            again = sched.submit([corrupt])  # looked up again: the tier remembers the miss
            sched.run(20)

            assert good.hits == 1 and good.bytes_ok
            assert bad.hits == 0 and again.hits == 0, "a corrupted value must never be promoted"
            assert integrity_failures() == integrity_before + 1
            assert tier.stats.total("vllm:kv_offload_memkv_jobs_failed", ("load",)) == failed_before + 1
            assert tier.client.exists(tier.namespace.keys([corrupt, clean])) == [False, True], "not purged"
    figures(flipped_stored_value="caught by checksum, promotion failed, key purged", integrity_failures=1)
