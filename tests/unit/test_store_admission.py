"""Store admission (memkv_vllm/admission.py): what the tier keeps of each request is a prefix.

Claims: a job is admitted or shed whole; an empty backlog admits any job, however large; a job
that would take the backlog over the limit is shed and so is every later job of the same
request, even once the backlog has drained, until the request is forgotten; other requests are
unaffected; released bytes make room again; a request that has not stored anything yet starts
only within half of the bound, so prompts under way are finished first; the jobs of a request
that arrive within one scheduler step (in any order, as under tensor parallelism) are admitted
or shed together, following the first of them; the shed WARNING names the key to raise and is
rate-limited while every block is still reported to the caller; TierSettings derives the limit
from the CPU pool when max_store_backlog_mb is not set.
"""

from __future__ import annotations

import logging

import pytest

from memkv.errors import ConfigError
from memkv_vllm.admission import StoreAdmission
from memkv_vllm.config import TierSettings

pytestmark = pytest.mark.unit

MIB = 1 << 20


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_empty_backlog_admits_a_job_larger_than_the_limit_whole():
    adm = StoreAdmission(8 * MIB)
    assert adm.admit("a", 64, 64 * MIB)
    assert adm.backlog_bytes == 64 * MIB


def test_a_job_over_the_limit_is_shed_whole_and_the_request_stays_cut_until_forgotten():
    adm = StoreAdmission(8 * MIB)
    assert adm.admit("a", 4, 4 * MIB)
    assert not adm.admit("b", 8, 8 * MIB)  # 4 + 8 > 8: shed whole
    adm.end_step()
    assert adm.admit("a", 4, 4 * MIB)  # 4 + 4 <= 8: a, under way, may fill the bound
    adm.end_step()
    assert not adm.admit("a", 1, MIB)  # 9 > 8: now a is cut too
    adm.release(8 * MIB)
    assert adm.backlog_bytes == 0
    assert not adm.admit("b", 1, MIB)  # b stays cut although the backlog is empty
    assert adm.admit("c", 1, MIB)
    adm.forget("b")
    assert adm.admit("b", 1, MIB)  # a finished request id carries nothing over


def test_concurrent_requests_are_kept_or_cut_one_by_one_never_interleaved():
    adm = StoreAdmission(10 * MIB)
    kept: dict[str, list[int]] = {r: [] for r in "abc"}
    # Three long prompts, one 4 MiB job each per step, nothing drains for three steps.
    for step in range(3):
        for r in "abc":
            if adm.admit(r, 4, 4 * MIB):
                kept[r].append(step)
        adm.end_step()
    # a starts (4 <= 5, half the bound); b and c may not start (8 > 5) and are cut from their
    # start; a, under way, continues to 8 <= 10 and is cut at step 2 (12 > 10).
    assert kept == {"a": [0, 1], "b": [], "c": []}
    for r, steps in kept.items():
        assert steps == list(range(len(steps))), f"request {r} kept a non-prefix {steps}"


def test_a_new_request_starts_only_within_half_of_the_bound():
    adm = StoreAdmission(10 * MIB)
    assert adm.admit("a", 4, 4 * MIB)
    assert not adm.admit("b", 2, 2 * MIB)  # 6 > 5: b would eat the room a needs to finish
    adm.end_step()
    assert adm.admit("a", 6, 6 * MIB)  # 10 <= 10
    adm.release(10 * MIB)
    assert adm.admit("c", 5, 5 * MIB)  # 5 <= 5
    adm.release(5 * MIB)
    assert adm.admit("d", 50, 50 * MIB)  # an empty backlog admits anything


def test_jobs_of_a_request_within_one_step_follow_the_first_in_any_order():
    # TP=2 with a lagging rank: the prompt's three jobs complete in one step, last one first.
    adm = StoreAdmission(MIB)
    assert [adm.admit("r", 16, 16 * MIB) for _ in range(3)] == [True, True, True]  # past the bound
    adm.release(48 * MIB)
    # The same with the backlog busy: the step's first job of s is shed, the others follow it.
    assert adm.admit("x", 1, MIB)
    adm.end_step()
    assert [adm.admit("s", 4, 4 * MIB) for _ in range(3)] == [False, False, False]
    adm.end_step()
    adm.release(MIB)
    assert not adm.admit("s", 1, MIB)  # and s stays cut in the steps after
    # Across steps the bound applies again to a request admitted before.
    assert adm.admit("r", 1, MIB)  # an empty backlog admits
    adm.end_step()
    assert not adm.admit("r", 1, MIB)  # 1 + 1 > 1


def test_the_shed_warning_names_the_key_and_is_rate_limited(caplog):
    clock = FakeClock()
    adm = StoreAdmission(4 * MIB, warn_interval_s=30.0, clock=clock)
    assert adm.admit("a", 4, 4 * MIB)
    with caplog.at_level(logging.WARNING, logger="vllm.memkv_vllm"):
        for i in range(5):
            assert not adm.admit(f"r{i}", 2, 2 * MIB)
        first = [r.getMessage() for r in caplog.records]
        clock.now += 31
        assert not adm.admit("late", 3, 3 * MIB)
    messages = [r.getMessage() for r in caplog.records]
    assert len(first) == 1 and len(messages) == 2
    assert "max_store_backlog_mb" in first[0] and "cpu_bytes_to_use" in first[0]
    # The second warning sums up what was shed since the first: r1..r4 (8 blocks) + late (3).
    assert "shed 11 block(s) of 5 request(s)" in messages[1]


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="limit_bytes"):
        StoreAdmission(0)
    with pytest.raises(ValueError, match="new_request_share"):
        StoreAdmission(MIB, new_request_share=0)


def test_the_default_backlog_is_half_of_the_cpu_pool_and_an_explicit_key_wins():
    assert TierSettings.from_tier_config({}).store_backlog_bytes(24 << 30) == 12 << 30
    assert TierSettings.from_tier_config({"max_store_backlog_mb": None}).store_backlog_bytes(1 << 30) == 512 * MIB
    assert TierSettings.from_tier_config({"max_store_backlog_mb": 100}).store_backlog_bytes(24 << 30) == 100 * MIB
    for bad in (0, -1, 1.5, "2048", True):
        with pytest.raises(ConfigError, match="max_store_backlog_mb"):
            TierSettings.from_tier_config({"max_store_backlog_mb": bad})
