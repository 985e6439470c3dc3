"""No stall: a node that stops, dies, restarts empty or is cut off mid-transfer never starves vLLM.

Behaviour under test, with vLLM's real TieringOffloadingManager, the memkv tier, two real nodes
and 64 requests of 2 chunks each (half owned by each node), looked up as the connector's
scheduler does (tier_sim.Scheduler):

* the starvation of the seed report, reproduced: with the tier's deadline off
  (`lookup_timeout_s: 0`, the unguarded path) and one node SIGSTOPped, every request with a chunk
  on that node stays deferred on RETRY and none of them completes for the whole observation
  window, while the other node's requests complete, byte-exact (answers are taken per node);
* with the deadline on, the same stall resolves every request within `lookup_timeout_s` plus one
  scheduler step, a second wave arriving during the stall does too, the live node's chunks hit
  in both waves, and once the node continues requests hit again, byte-exact;
* three nodes, one SIGSTOPped, the client's io_timeout_s a minute: requests whose chunks all
  live on the two healthy nodes hit at once, in a first wave and in a second one submitted while
  the stopped node still owes the first round's answers, while every request on the stopped node
  is still pending; those resolve as misses at the deadline, and after SIGCONT they hit again;
* a node SIGKILLed, or restarted empty on the same port: every request resolves within the
  deadline plus one step, the live node's chunks still promote byte-exact, the lost node's are
  misses (only cache is lost), and chunks stored again after the restart promote again;
* a partition in the middle of a promotion's transfer (a proxy stops forwarding, sockets open):
  lookups still resolve within the deadline plus one step, and the request waiting on the cut
  promotion resolves (as a miss) within the client's io_timeout_s plus one step and the deadline.

All nodes listen on 127.0.0.1; every wait is a bounded step loop or a bounded poll.
"""

from __future__ import annotations

import signal

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.factory", reason="tier fault tests need vLLM (run them in a nox venv)")

from tests.conformance import vllm_harness as h
from tests.faults import tier_sim as ts
from tests.faults.figures import scaled_s
from tests.faults.nodeops import NO_LOCAL_SOCKET, all_threads_stopped, restart_empty
from tests.faults.proxy import S2C, Fault, FaultProxy

pytestmark = [pytest.mark.faults, pytest.mark.conformance]  # conformance: runs in each nox vLLM session

N_REQUESTS = 64
CHUNKS = 2
DEADLINE_S = 1.0  # lookup_timeout_s under test (the default, 5 s, only lengthens the waits)
STEP_S = 0.01
SLACK_S = 0.35  # scheduling noise on a busy 2-core box
UNGUARDED_WINDOW_S = min(max(3.0, scaled_s(3.0)), 60.0)
GEOMETRY = h.Geometry(num_rows=160)  # room for every promotion of a wave
LookupResult = h.LookupResult


@pytest.fixture
def nodes(start_node):
    return start_node.many(2, capacity="64MiB")


def corpus(monkeypatch, nodes, key_hex, addresses=None):
    return ts.corpus(monkeypatch, nodes, key_hex, N_REQUESTS, GEOMETRY, addresses)


def submit_wave(sched: ts.Scheduler, a_keys, b_keys) -> tuple[list, list]:
    return ts.submit_wave(sched, a_keys, b_keys, N_REQUESTS, CHUNKS)


assert_wave_resolved_within = ts.assert_resolved_within


def stop(node, wait_until) -> None:
    node.signal(signal.SIGSTOP)
    wait_until(lambda: all_threads_stopped(node.pid), 5.0, what="the node's threads to stop")


def test_unguarded_tier_defers_every_request_on_a_stopped_node_with_zero_completions(
    monkeypatch, nodes, auth_key_hex, tmp_path, wait_until, figures
):
    a_keys, b_keys, payloads = corpus(monkeypatch, nodes, auth_key_hex)
    # The unguarded path: no tier deadline, and a transport timeout longer than the window.
    config = ts.client_config(tmp_path, io_timeout_s=UNGUARDED_WINDOW_S + 60)
    ts.point_tier_at(monkeypatch, [n.address for n in nodes], auth_key_hex, config)
    with h.HeadlessEngine([ts.memkv_tier(lookup_timeout_s=0)], GEOMETRY) as engine:
        sched = ts.Scheduler(engine, payloads, STEP_S)
        stop(nodes[0], wait_until)
        try:
            on_a, on_b = submit_wave(sched, a_keys, b_keys)
            took = sched.run(UNGUARDED_WINDOW_S, until_resolved=False)
            answers = set().union(*(s.answers for s in on_a))
            deferred = sum(s in sched.waiting for s in on_a)
            completed = sum(s in sched.done for s in on_a)
        finally:
            nodes[0].signal(signal.SIGCONT)
    assert deferred == len(on_a) and not completed, f"{completed} requests on the stopped node completed"
    assert answers == {LookupResult.RETRY}, answers
    # The stopped node holds only its own requests: the live node's hit, byte-exact.
    assert all(s in sched.done and s.hits == CHUNKS and s.bytes_ok for s in on_b), [
        (s.resolved_at, s.hits, s.bytes_ok) for s in on_b
    ][:4]
    figures(
        unguarded_deferred=deferred,
        unguarded_requests=len(on_a),
        unguarded_completions=completed,
        unguarded_healthy_completed=sum(s in sched.done for s in on_b),
        unguarded_healthy_requests=len(on_b),
        unguarded_window_s=round(took, 2),
        unguarded_steps=sched.steps,
    )


def test_deadline_resolves_every_lookup_within_timeout_plus_one_step_while_a_node_is_stopped(
    monkeypatch, nodes, auth_key_hex, tmp_path, wait_until, figures
):
    a_keys, b_keys, payloads = corpus(monkeypatch, nodes, auth_key_hex)
    config = ts.client_config(tmp_path, io_timeout_s=60.0)  # the transport alone would wait a minute
    ts.point_tier_at(monkeypatch, [n.address for n in nodes], auth_key_hex, config)
    with h.HeadlessEngine([ts.memkv_tier(lookup_timeout_s=DEADLINE_S)], GEOMETRY) as engine:
        sched = ts.Scheduler(engine, payloads, STEP_S)
        stop(nodes[0], wait_until)
        try:
            first_a, first_b = submit_wave(sched, a_keys, b_keys)
            first = first_a + first_b
            sched.run(DEADLINE_S + 10)
            worst1 = assert_wave_resolved_within(sched, first, DEADLINE_S + sched.worst_step_gap() + SLACK_S, "wave 1")
            second_a, second_b = submit_wave(sched, a_keys, b_keys)  # more requests arrive during the stall
            second = second_a + second_b
            sched.run(DEADLINE_S + 10)
            worst2 = assert_wave_resolved_within(sched, second, DEADLINE_S + sched.worst_step_gap() + SLACK_S, "wave 2")
            timeouts = ts.tier_of(engine).stats.total("vllm:kv_offload_memkv_lookups", ("timeout",))
        finally:
            nodes[0].signal(signal.SIGCONT)
        assert timeouts >= 1
        # Answers are taken per node: the live node's chunks hit in both waves, byte-exact.
        live = first_b + second_b
        assert all(s.hits == CHUNKS and s.bytes_ok for s in live), [(s.hits, s.bytes_ok) for s in live][:4]
        # Once the node continues, the same chunks promote again, byte-exact.
        third = [s for part in submit_wave(sched, a_keys, b_keys) for s in part]
        sched.run(30)
        assert_wave_resolved_within(sched, third, 30, "after SIGCONT")
        hits = sum(s.hits for s in third)
    assert hits == N_REQUESTS * CHUNKS, f"only {hits} chunks hit after the node continued"
    assert all(s.bytes_ok for s in third)
    figures(
        stopped_worst_resolution_s=round(max(worst1, worst2), 3),
        lookup_timeout_s=DEADLINE_S,
        stopped_completed=len(first) + len(second),
        stopped_recovered_hits=hits,
        stall_healthy_node_hits=sum(s.hits for s in first_b + second_b),
        worst_step_gap_s=round(sched.worst_step_gap(), 3),
    )


THREE_NODE_DEADLINE_S = 3.0  # long enough that "the healthy nodes' requests resolved first" shows on a busy box
THREE_NODE_REQUESTS = 16  # per group: on the stopped node; healthy wave 1; healthy wave 2


def test_stopped_node_holds_only_its_own_requests_and_healthy_nodes_hit_at_once(
    monkeypatch, start_node, auth_key_hex, tmp_path, wait_until, figures
):
    n = THREE_NODE_REQUESTS
    nodes = start_node.many(3, capacity="64MiB")
    (on_stopped, k1, k2), payloads = ts.corpus_by_node(monkeypatch, nodes, auth_key_hex, n * CHUNKS, GEOMETRY)
    config = ts.client_config(tmp_path, io_timeout_s=60.0)  # the transport alone would hold a round a minute
    ts.point_tier_at(monkeypatch, [x.address for x in nodes], auth_key_hex, config)
    with h.HeadlessEngine([ts.memkv_tier(lookup_timeout_s=THREE_NODE_DEADLINE_S)], GEOMETRY) as engine:
        sched = ts.Scheduler(engine, payloads, STEP_S)
        stop(nodes[0], wait_until)
        try:
            stopped = [sched.submit(on_stopped[i * CHUNKS : (i + 1) * CHUNKS]) for i in range(n)]
            healthy1 = [sched.submit([k1[i], k2[i]]) for i in range(n)]  # a chunk on each healthy node
            sched.run(THREE_NODE_DEADLINE_S + 10, until=lambda: all(s.resolved_at is not None for s in healthy1))
            pending1 = sum(s.resolved_at is None for s in stopped)
            # A second wave while the stopped node still owes the first round's answers.
            healthy2 = [sched.submit([k1[n + i], k2[n + i]]) for i in range(n)]
            sched.run(THREE_NODE_DEADLINE_S + 10, until=lambda: all(s.resolved_at is not None for s in healthy2))
            pending2 = sum(s.resolved_at is None for s in stopped)
            sched.run(THREE_NODE_DEADLINE_S + 10)  # the stopped node's requests: misses at the deadline
            timeouts = ts.tier_of(engine).stats.total("vllm:kv_offload_memkv_lookups", ("timeout",))
        finally:
            nodes[0].signal(signal.SIGCONT)
        healthy = healthy1 + healthy2
        assert pending1 == pending2 == n, f"stopped-node requests resolved early: {n - pending1}, {n - pending2}"
        assert all(s.hits == CHUNKS and s.bytes_ok for s in healthy), [(s.hits, s.bytes_ok) for s in healthy][:4]
        last_healthy = max(s.resolved_at for s in healthy)
        worst_stopped = assert_wave_resolved_within(
            sched, stopped, THREE_NODE_DEADLINE_S + sched.worst_step_gap() + SLACK_S, "requests on the stopped node"
        )
        assert last_healthy < min(s.resolved_at for s in stopped), "a healthy request waited for the stopped node"
        assert all(s.hits == 0 for s in stopped) and worst_stopped >= THREE_NODE_DEADLINE_S - STEP_S
        assert timeouts >= n
        # Once the node continues it answers the round it owed, and its chunks hit again.
        after = [sched.submit(on_stopped[i * CHUNKS : (i + 1) * CHUNKS]) for i in range(n)]
        sched.run(30)
        assert_wave_resolved_within(sched, after, 30, "after SIGCONT")
        recovered = sum(s.hits for s in after)
    assert recovered == n * CHUNKS and all(s.bytes_ok for s in after), f"only {recovered} chunks hit after SIGCONT"
    figures(
        three_node_healthy_hits=sum(s.hits for s in healthy),
        three_node_healthy_requests=len(healthy),
        three_node_healthy_worst_resolution_s=round(max(s.resolution_s for s in healthy), 3),
        three_node_stopped_worst_resolution_s=round(worst_stopped, 3),
        three_node_lookup_timeout_s=THREE_NODE_DEADLINE_S,
        three_node_recovered_hits=recovered,
    )


def test_killed_node_costs_only_its_chunks_and_every_request_resolves_in_time(
    monkeypatch, nodes, auth_key_hex, tmp_path, figures
):
    a_keys, b_keys, payloads = corpus(monkeypatch, nodes, auth_key_hex)
    config = ts.client_config(tmp_path, io_timeout_s=2.0)
    ts.point_tier_at(monkeypatch, [n.address for n in nodes], auth_key_hex, config)
    with h.HeadlessEngine([ts.memkv_tier(lookup_timeout_s=DEADLINE_S)], GEOMETRY) as engine:
        sched = ts.Scheduler(engine, payloads, STEP_S)
        nodes[0].kill()
        on_a, on_b = submit_wave(sched, a_keys, b_keys)
        sched.run(DEADLINE_S + 10)
        worst = assert_wave_resolved_within(sched, on_a + on_b, DEADLINE_S + sched.worst_step_gap() + SLACK_S, "killed")
    assert all(s.hits == 0 for s in on_a), "a dead node's chunk cannot hit"
    assert all(s.hits == CHUNKS and s.bytes_ok for s in on_b), [(s.hits, s.bytes_ok) for s in on_b if s.hits != CHUNKS]
    figures(killed_worst_resolution_s=round(worst, 3), killed_live_node_hits=sum(s.hits for s in on_b))


def test_node_restarted_empty_loses_only_cache_and_every_request_resolves_in_time(
    monkeypatch, nodes, start_node, auth_key_hex, tmp_path, wait_until, figures
):
    a_keys, b_keys, payloads = corpus(monkeypatch, nodes, auth_key_hex)
    config = ts.client_config(tmp_path, io_timeout_s=2.0, down_for_s=0.3)
    ts.point_tier_at(monkeypatch, [n.address for n in nodes], auth_key_hex, config)
    with h.HeadlessEngine([ts.memkv_tier(lookup_timeout_s=DEADLINE_S)], GEOMETRY) as engine:
        sched = ts.Scheduler(engine, payloads, STEP_S)
        fresh = restart_empty(nodes[0], capacity="64MiB")  # its pooled sockets are now dead
        start_node.nodes.append(fresh)
        on_a, on_b = submit_wave(sched, a_keys, b_keys)
        sched.run(DEADLINE_S + 10)
        worst = assert_wave_resolved_within(
            sched, on_a + on_b, DEADLINE_S + sched.worst_step_gap() + SLACK_S, "restarted"
        )
        assert all(s.hits == 0 for s in on_a), "an empty node cannot hit"
        assert all(s.hits == CHUNKS and s.bytes_ok for s in on_b)
        # The lost chunks are stored again (as recomputed blocks would be) and promote again.
        with h.HeadlessEngine([ts.memkv_tier()], GEOMETRY) as writer:
            again = ts.store_all(writer, a_keys)
        assert again == {k: payloads[k] for k in a_keys}
        # The tier's client marked the restarted node down when its old sockets failed; the
        # mark lasts down_for_s (a miss meanwhile, never an error).
        wait_until(
            lambda: all(n["up"] for n in ts.tier_of(engine).client.health()), 5.0, what="the down mark to expire"
        )
        refill = [sched.submit(a_keys[i * CHUNKS : (i + 1) * CHUNKS]) for i in range(N_REQUESTS // 2)]
        sched.run(30)
        assert_wave_resolved_within(sched, refill, 30, "after re-store")
    assert all(s.hits == CHUNKS and s.bytes_ok for s in refill), [(s.hits, s.bytes_ok) for s in refill][:4]
    figures(restarted_worst_resolution_s=round(worst, 3), restarted_refill_hits=sum(s.hits for s in refill))


def test_partition_mid_promotion_resolves_within_io_timeout_and_lookups_within_deadline(
    monkeypatch, start_node, auth_key_hex, tmp_path, wait_until, figures
):
    io_timeout_s = 2.0
    nodes = start_node.many(2, capacity="64MiB", extra_args=[NO_LOCAL_SOCKET])
    proxies = [FaultProxy((n.host, n.port), name=f"p{i}") for i, n in enumerate(nodes)]
    try:
        addresses = [px.address for px in proxies]
        a_keys, b_keys, payloads = corpus(monkeypatch, nodes, auth_key_hex, addresses)
        cut = proxies[0]

        def partition_mid_value(frame):
            if frame.direction == S2C and frame.payload_len and not cut.applied:
                return Fault.call(frame.payload_start + frame.payload_len // 2, cut.partition)
            return None

        config = ts.client_config(tmp_path, io_timeout_s=io_timeout_s, down_for_s=0.5)
        ts.point_tier_at(monkeypatch, addresses, auth_key_hex, config)
        with h.HeadlessEngine([ts.memkv_tier(lookup_timeout_s=DEADLINE_S)], GEOMETRY) as engine:
            sched = ts.Scheduler(engine, payloads, STEP_S)
            cut.plan = partition_mid_value
            on_a, on_b = submit_wave(sched, a_keys, b_keys)
            sched.run(io_timeout_s * 6 + 10)
            assert cut.applied, "the partition never started: no promotion crossed the proxy"
            # A promotion in flight is bounded by the client's io_timeout_s (the lookup deadline
            # covers probes, not transfers); nothing waits on the cut node for longer.
            bound = io_timeout_s + DEADLINE_S + sched.worst_step_gap() + SLACK_S
            worst_a = assert_wave_resolved_within(sched, on_a, bound, "requests on the cut node")
            worst_b = assert_wave_resolved_within(sched, on_b, bound, "requests on the live node")
            # New lookups during the partition, once the client tries the cut node again (its down
            # mark expired): the probe hangs on the black hole, the deadline answers MISS.
            wait_until(
                lambda: all(n["up"] for n in ts.tier_of(engine).client.health()), 5.0, what="the down mark to expire"
            )
            during = [sched.submit(a_keys[i * CHUNKS : (i + 1) * CHUNKS]) for i in range(8)]
            sched.run(DEADLINE_S + 10)
            worst_probe = assert_wave_resolved_within(
                sched, during, DEADLINE_S + sched.worst_step_gap() + SLACK_S, "lookups during the partition"
            )
            cut.heal()
    finally:
        for px in proxies:
            px.close()
    assert all(s.bytes_ok is not False for s in on_a + on_b)
    assert sum(s.hits for s in on_b) > 0, "the live node's chunks should still promote"
    figures(
        partition_worst_promotion_resolution_s=round(worst_a, 3),
        partition_live_node_worst_s=round(worst_b, 3),
        partition_worst_lookup_resolution_s=round(worst_probe, 3),
        client_io_timeout_s=io_timeout_s,
        lookup_timeout_s=DEADLINE_S,
    )
