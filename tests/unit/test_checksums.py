"""A batch's checksums: made at once on the hashing threads where the host has cores to spare,
identical to one after the other, in order, and still made in a child forked from a process that
had its hashing threads running."""

from __future__ import annotations

import os
import threading

import pytest

from memkv import integrity
from memkv.integrity import Checksummer
from memkv.protocol import ChecksumAlgo

pytestmark = pytest.mark.unit

KEY = bytes(range(32))
MiB = 1 << 20


def _values(n: int, size: int) -> list[memoryview]:
    return [memoryview(bytes([i]) * 7 + os.urandom(size - 7)) for i in range(n)]


@pytest.fixture
def spare_cores(monkeypatch):
    """The hashing threads on whatever this machine has (the 2-vCPU CI box included)."""
    monkeypatch.setattr(integrity, "PARALLEL_MIN_CPUS", 1)
    monkeypatch.setattr(integrity, "_pool", None)


@pytest.mark.parametrize("algo", [ChecksumAlgo.XXH3_128, ChecksumAlgo.BLAKE3_KEYED], ids=["xxh3", "blake3"])
def test_a_batch_hashed_at_once_gives_each_value_its_own_checksum_in_order(spare_cores, algo):
    summer = Checksummer(KEY, algo)
    values = _values(6, 2 * MiB)
    on: set[str] = set()
    compute = summer.compute

    def recording(value, algo=None):
        on.add(threading.current_thread().name)
        return compute(value, algo)

    summer.compute = recording  # type: ignore[method-assign]
    got = summer.compute_all(values)
    assert got == [compute(v) for v in values]
    assert len(set(got)) == len(values)
    assert on and all(name.startswith("memkv-hash") for name in on), on


def test_small_values_and_single_values_are_hashed_by_the_caller(spare_cores):
    summer = Checksummer(KEY)
    me = threading.current_thread().name
    for values in (_values(8, 64 << 10), _values(1, 4 * MiB)):
        on: set[str] = set()
        compute = summer.compute

        def recording(value, algo=None, on=on, compute=compute):
            on.add(threading.current_thread().name)
            return compute(value, algo)

        summer.compute = recording  # type: ignore[method-assign]
        assert summer.compute_all(values) == [compute(v) for v in values]
        assert on == {me}
        summer.compute = compute  # type: ignore[method-assign]


def test_a_host_with_too_few_cpus_gets_no_hashing_threads(monkeypatch):
    monkeypatch.setattr(integrity, "PARALLEL_MIN_CPUS", len(os.sched_getaffinity(0)) + 1)
    monkeypatch.setattr(integrity, "_pool", None)
    assert integrity.hash_pool() is None
    values = _values(4, 2 * MiB)
    assert Checksummer(KEY).compute_all(values) == [Checksummer(KEY).compute(v) for v in values]


def test_a_forked_child_makes_its_own_hashing_threads(spare_cores):
    summer = Checksummer(KEY)
    values = _values(4, 2 * MiB)
    want = [summer.compute(v) for v in values]
    assert summer.compute_all(values) == want  # the parent's threads exist now
    parent_pool = integrity.hash_pool()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's threads are gone; its batch must not wait for them
        try:
            ok = summer.compute_all(values) == want and integrity.hash_pool() is not parent_pool
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    try:
        done, status = 0, 0
        for _ in range(200):  # bounded: 10 s
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            threading.Event().wait(0.05)
        if not done:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's batch did not finish within 10 s")
        assert os.read(read, 1) == b"1"
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        os.close(read)
