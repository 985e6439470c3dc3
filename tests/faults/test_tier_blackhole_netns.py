"""No stall behind a real network black hole (a network namespace whose link is cut).

Behaviour under test, with vLLM's real TieringOffloadingManager and the memkv tier: one node runs
in its own network namespace behind a veth pair, the other on 127.0.0.1. Cutting the link drops
every packet to the first node silently (no RST, no ICMP: TCP retransmits into the void). With the
tier's deadline off, every one of the 32 requests on that node stays deferred on RETRY with zero
completions for the whole window -- the seed report's starvation, on a real black hole rather than
a stopped process -- while the 32 requests on the reachable node complete (answers are taken per
node). With `lookup_timeout_s`, every request resolves within the deadline plus one step.

Needs root and iproute2 (namespaces, veth); skips cleanly otherwise.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.factory", reason="tier fault tests need vLLM (run them in a nox venv)")

from tests.conformance import vllm_harness as h
from tests.faults import tier_sim as ts
from tests.faults.figures import scaled_s
from tests.netns import NetnsHost

pytestmark = [pytest.mark.faults, pytest.mark.conformance]  # conformance: runs in each nox vLLM session

_why_not = NetnsHost.available()
if _why_not:
    pytestmark.append(pytest.mark.skip(reason=f"network namespaces unavailable: {_why_not}"))

LookupResult = h.LookupResult
N_REQUESTS, CHUNKS = 64, 2
DEADLINE_S = 1.0
STEP_S = 0.01
SLACK_S = 0.35
UNGUARDED_WINDOW_S = min(max(3.0, scaled_s(3.0)), 60.0)
GEOMETRY = h.Geometry(num_rows=160)


@pytest.fixture
def blackhole():
    net = NetnsHost()
    try:
        yield net
    finally:
        net.close()


def test_black_holed_node_starves_only_the_unguarded_tier(
    monkeypatch, blackhole, start_node, auth_key_hex, tmp_path, figures
):
    far = blackhole.start_node(auth_key_hex)
    try:
        near = start_node(capacity="64MiB")
        nodes = [far, near]
        a_keys, b_keys, payloads = ts.corpus(monkeypatch, nodes, auth_key_hex, N_REQUESTS, GEOMETRY)
        config = ts.client_config(tmp_path, io_timeout_s=UNGUARDED_WINDOW_S + 60)
        ts.point_tier_at(monkeypatch, [n.address for n in nodes], auth_key_hex, config)

        with h.HeadlessEngine([ts.memkv_tier(lookup_timeout_s=0)], GEOMETRY) as engine:
            unguarded = ts.Scheduler(engine, payloads, STEP_S)
            blackhole.cut()
            try:
                on_far, on_near = ts.submit_wave(unguarded, a_keys, b_keys, N_REQUESTS, CHUNKS)
                window = unguarded.run(UNGUARDED_WINDOW_S, until_resolved=False)
                answers = set().union(*(s.answers for s in on_far))
                deferred = sum(s in unguarded.waiting for s in on_far)
                near_done = sum(s in unguarded.done and s.hits == CHUNKS and bool(s.bytes_ok) for s in on_near)
            finally:
                blackhole.heal()
        assert deferred == len(on_far) and not any(s in unguarded.done for s in on_far)
        assert answers == {LookupResult.RETRY}
        assert near_done == len(on_near), f"only {near_done} of the reachable node's requests hit"

        with h.HeadlessEngine([ts.memkv_tier(lookup_timeout_s=DEADLINE_S)], GEOMETRY) as engine:
            guarded = ts.Scheduler(engine, payloads, STEP_S)
            blackhole.cut()
            try:
                wave = [s for part in ts.submit_wave(guarded, a_keys, b_keys, N_REQUESTS, CHUNKS) for s in part]
                guarded.run(DEADLINE_S + 10)
                worst = ts.assert_resolved_within(
                    guarded, wave, DEADLINE_S + guarded.worst_step_gap() + SLACK_S, "black hole"
                )
            finally:
                blackhole.heal()
    finally:
        far.stop()
    figures(
        blackhole_unguarded_deferred=deferred,
        blackhole_unguarded_requests=len(on_far),
        blackhole_unguarded_completions=0,
        blackhole_unguarded_healthy_completed=near_done,
        blackhole_unguarded_window_s=round(window, 2),
        blackhole_worst_resolution_s=round(worst, 3),
        lookup_timeout_s=DEADLINE_S,
    )
