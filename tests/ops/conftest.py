"""Fixtures for the operator-facing tests (deploy/, docs/, the `memkv` operator commands).

* `ops_key`: one fresh 64-hex auth key per test module.
* `ops_nodes(n, capacity=..., extra_args=...)`: starts n real `memkv serve` processes
  (memkv.local.LocalNode) on 127.0.0.1 with the admin port on data port + 1, as in
  production, so `memkv status` finds it without flags; every node is stopped when the module
  ends, in `finally`.
* `memkv_cli(*args, env=..., stdin=...)`: runs `python -m memkv ...` in a clean environment (no
  inherited MEMKV_* variable, a private XDG_CONFIG_HOME) and returns the CompletedProcess;
  bounded by a timeout.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from memkv.local import new_key_hex
from tests.ops.helpers import Nodes, clean_env


@pytest.fixture(scope="module")
def ops_key() -> str:
    return new_key_hex()


@pytest.fixture(scope="module")
def ops_nodes(ops_key: str) -> Iterator[Nodes]:
    nodes = Nodes(ops_key)
    try:
        yield nodes
    finally:
        nodes.stop_all()


@pytest.fixture
def memkv_cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    def run(
        *args: str, env: dict[str, str] | None = None, stdin: bytes | None = None, timeout_s: float = 60.0
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "memkv", *args],
            env=clean_env(tmp_path, **(env or {})),
            input=stdin,
            capture_output=True,
            timeout=timeout_s,
            cwd=tmp_path,
        )

    return run
