"""Slot safety in vLLM: a promotion abandoned by timeout never writes into a row after its job was
reported.

Behaviour under test, with vLLM's real TieringOffloadingManager and the memkv tier: a proxy in
front of the node lets half of a promotion's value through, holds the rest past the client's
io_timeout_s, then delivers it late. The tier reports the load job failed within the timeout
(plus a step); the destination rows, snapshotted at the moment the job is reported to vLLM, do
not change afterwards -- not when the late bytes are released, nor after. The block then looks
up as a miss for that request (it recomputes); the value in MemKV was never bad, so a later
request promotes it byte-exact.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.factory", reason="tier fault tests need vLLM (run them in a nox venv)")

from memkv_vllm import compat
from tests.conformance import vllm_harness as h
from tests.conftest import poll_until
from tests.faults import tier_sim as ts
from tests.faults.nodeops import NO_LOCAL_SOCKET
from tests.faults.proxy import S2C, Fault, FaultProxy

pytestmark = [pytest.mark.faults, pytest.mark.conformance]  # conformance: runs in each nox vLLM session

IO_TIMEOUT_S = 0.5
HOLD_S = IO_TIMEOUT_S * 4


@pytest.mark.over_tls_too  # [tls]: the stall lands inside a TLS stream (a TLS-only node, a TLS proxy)
def test_abandoned_promotion_never_writes_into_its_rows_after_the_job_was_reported(
    monkeypatch, start_node, auth_key_hex, tmp_path, figures
):
    node = start_node(capacity="64MiB", extra_args=[NO_LOCAL_SOCKET])
    stall_armed = [False]

    def plan(frame):
        if stall_armed[0] and frame.direction == S2C and frame.payload_len:
            stall_armed[0] = False
            return Fault.stall(
                frame.payload_start + frame.payload_len // 4, hold_s=HOLD_S, release=True
            )  # inside the first value
        return None

    geometry = h.Geometry(worker_kv_bytes_per_block=128 << 10, num_rows=16)  # 256 KiB rows
    with FaultProxy((node.host, node.port), plan, name="slot", tls=node.client_tls is not None) as proxy:
        config = ts.client_config(tmp_path, io_timeout_s=IO_TIMEOUT_S, down_for_s=0.05)
        ts.point_tier_at(monkeypatch, [proxy.address], auth_key_hex, config, tls=node.client_tls)
        with h.HeadlessEngine([ts.memkv_tier(blocks_per_op=4)], geometry) as engine:
            tier = ts.tier_of(engine)
            keys = h.make_keys(2)
            payloads = ts.store_all(engine, keys)
            engine.reset_cache()

            load_rows: dict[int, list[int]] = {}
            reports: list[tuple[float, int, dict[int, bytes]]] = []
            real_submit, real_finished = tier.submit_load, tier.get_finished_jobs

            def spy_submit(job):
                load_rows[job.job_id] = [int(s) for s in compat.job_slot_ids(job)]
                return real_submit(job)

            def spy_finished():
                results = real_finished()
                for r in results:
                    if r.job_id in load_rows and not r.success:
                        rows = load_rows[r.job_id]
                        reports.append((time.monotonic(), r.job_id, {row: engine.read_row(row) for row in rows}))
                return results

            monkeypatch.setattr(tier, "submit_load", spy_submit)
            monkeypatch.setattr(tier, "get_finished_jobs", spy_finished)
            stall_armed[0] = True
            sched = ts.Scheduler(engine, payloads)
            first = sched.submit(keys)
            sched.run(HOLD_S + 10)
            assert first.resolved_at is not None and first.hits == 0, "the abandoned promotion must be a miss"
            (applied,) = proxy.applied
            assert reports, "the failed load job was never reported"
            reported_at, job_id, snapshot = reports[0]
            assert reported_at - applied.started < IO_TIMEOUT_S + 1.0, "the job was not reported within the timeout"
            assert applied.done.wait(HOLD_S + 5), "the proxy never released the late bytes"
            late_at = time.monotonic()
            assert late_at > reported_at
            # The rows must not change after the report: watch them past the late delivery.
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                for row, before in snapshot.items():
                    assert engine.read_row(row) == before, f"row {row} changed after job {job_id} was reported"
                applied.done.wait(0.02)
            # The values in MemKV were never bad, only their transfer: once the client's down mark
            # expires, a new request promotes the same chunks, byte-exact.
            poll_until(lambda: all(n["up"] for n in tier.client.health()), 5.0, what="the down mark to expire")
            second = sched.submit(keys)
            sched.run(20)
    assert second.hits == 2 and second.bytes_ok and not sched.mismatches
    figures(
        abandoned_promotion_reported_after_s=round(reported_at - applied.started, 3),
        late_bytes_released_after_report_s=round(late_at - reported_at, 3),
        rows_untouched_after_report=True,
    )
