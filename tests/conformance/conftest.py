"""Fixtures for the conformance suite: real `memkv serve` nodes and the tier's environment.

The suite needs vLLM (a nox `conformance-<release>` session installs it); without it every
test here is skipped, so the plain test run stays fast.
"""

from __future__ import annotations

import glob
import os

import pytest

from memkv.local import LocalNode, new_key_hex

try:
    import vllm.v1.kv_offload.tiering.factory  # noqa: F401
except ImportError:  # the plain test run: skip this folder instead of failing to import it
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def auth_key_hex() -> str:
    return new_key_hex()


@pytest.fixture(scope="module")
def cluster(auth_key_hex):
    """Three nodes shared by a module's tests (each test uses its own random keys)."""
    nodes = [LocalNode(auth_key_hex, capacity="256MiB") for _ in range(3)]
    try:
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture
def private_cluster(auth_key_hex):
    """Two nodes for one test that kills, stops or fills them."""
    nodes = [LocalNode(auth_key_hex, capacity="256MiB") for _ in range(2)]
    try:
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def point_at(monkeypatch, nodes, key_hex: str) -> None:
    """Configure the tier's client (it reads the MEMKV_* environment) for these nodes."""
    monkeypatch.setenv("MEMKV_SERVERS", ",".join(n.address for n in nodes))
    monkeypatch.setenv("MEMKV_AUTH_KEY", key_hex)
    for var in ("MEMKV_CONFIG", "MEMKV_LICENSE", "MEMKV_TRANSPORT"):
        monkeypatch.delenv(var, raising=False)
    if os.environ.get("MEMKV_TEST_TRANSPORT"):  # the whole suite over another transport (docs/rdma.md)
        monkeypatch.setenv("MEMKV_TRANSPORT", os.environ["MEMKV_TEST_TRANSPORT"])


@pytest.fixture
def memkv_env(monkeypatch, cluster, auth_key_hex):
    import memkv_vllm

    point_at(monkeypatch, cluster, auth_key_hex)
    memkv_vllm.register()
    return cluster


@pytest.fixture
def no_leaked_regions():
    """Releases up to 0.27 leak the /dev/shm region when a tier constructor raises
    (docs/vllm-api.md section 8); remove what a failing construction left behind."""
    before = set(glob.glob("/dev/shm/vllm_offload_*"))
    yield
    for path in set(glob.glob("/dev/shm/vllm_offload_*")) - before:
        os.unlink(path)
