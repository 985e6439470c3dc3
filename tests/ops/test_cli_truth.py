"""The `memkv` command never reports a success it did not see, and says what is wrong.

Behaviour under test (real nodes on 127.0.0.1, real `python -m memkv` runs):
* `bench` against a stopped node, or with a key the node does not hold, exits 1 with the cause
  (connect refused / the key) and prints no throughput, as text or as JSON; a good run labels
  its figures as the median of its rounds and says "1 round", not "1 rounds";
* `bench --help` describes every flag with its default;
* `get` and `put` with a wrong key say "authentication failed", not "unreachable";
* `status` checks the key with an authenticated PING on each data port (the admin port takes
  none): a wrong key is "auth failed" and exit 1; the table names stored vs allocated bytes;
* a client pointed at a node's admin port is told so at once (the admin port answers a MemKV
  hello in HTTP), not after a timeout;
* `memkv serve --capacity` above the machine's memory logs a WARNING; an ambiguous unit
  (`512mb`) is refused with exit 2 naming both spellings; `MEMKV_SERVERS` with `;` names the
  separator. Secrets are never printed.
"""

from __future__ import annotations

import socket
import time

import pytest

from memkv.config import host_memory_bytes
from memkv.local import LocalNode
from tests.ops.helpers import as_json

pytestmark = pytest.mark.integration

WRONG = "ab" * 32


@pytest.fixture(scope="module")
def node(ops_nodes):
    return ops_nodes(1)[0]


@pytest.fixture
def env(node, ops_key) -> dict[str, str]:
    return {"MEMKV_SERVERS": node.address, "MEMKV_AUTH_KEY": ops_key}


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


BENCH = ("bench", "--value-size", "1MiB", "--values", "4", "--rounds", "1", "--threads", "1")


@pytest.mark.parametrize("case", ["stopped-node", "wrong-key"])
def test_bench_that_cannot_store_fails_with_the_cause_and_prints_no_throughput(memkv_cli, env, ops_key, case) -> None:
    bad = {**env, "MEMKV_SERVERS": dead_address()} if case == "stopped-node" else {**env, "MEMKV_AUTH_KEY": WRONG}
    cause = "Connection refused" if case == "stopped-node" else "MEMKV_AUTH_KEY"
    text = memkv_cli(*BENCH, env=bad)
    out, err = text.stdout.decode(), text.stderr.decode()
    assert text.returncode == 1, (out, err)
    assert "GB/s" not in out and "GB/s" not in err
    assert "bench failed:" in err and cause in err
    doc = as_json(memkv_cli(*BENCH, "--json", env=bad))
    assert doc["ok"] is False and cause in doc["error"] and "put_gbps" not in doc
    assert ops_key not in out + err and WRONG not in out + err


def test_bench_labels_its_figures_as_the_median_and_counts_rounds_in_words(memkv_cli, env) -> None:
    proc = memkv_cli(*BENCH, env=env)
    out = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr
    assert "1 thread, 1 round," in out and "rounds" not in out
    assert "GB/s median of 1 round" in out and "verified byte-exact: True" in out


def test_bench_help_describes_every_flag_and_its_default(memkv_cli) -> None:
    text = " ".join(memkv_cli("bench", "--help").stdout.decode().split())  # argparse wraps lines
    for flag, default in (
        ("--value-size", "(default 16MiB)"),
        ("--values", "(default 32)"),
        ("--rounds", "(default 3)"),
        ("--threads", "(default 2)"),
    ):
        assert flag in text and default in text, (flag, default)
    assert "median" in text and "JSON object on stdout" in text


def test_get_and_put_with_a_wrong_key_say_authentication_failed(memkv_cli, env, ops_key) -> None:
    bad = {**env, "MEMKV_AUTH_KEY": WRONG}
    get = memkv_cli("get", "--json", "truth/k", env=bad)
    doc = as_json(get)
    assert (
        get.returncode == 1
        and doc["error"].startswith("authentication failed on server ")
        and "unreachable" not in doc["error"]
    )
    put = memkv_cli("put", "--json", "truth/k", "-", stdin=b"x", env=bad)
    assert put.returncode == 1 and as_json(put)["error"].startswith("authentication failed on server ")
    for proc in (get, put):
        assert ops_key.encode() not in proc.stdout + proc.stderr and WRONG.encode() not in proc.stdout + proc.stderr


def test_status_checks_the_key_on_the_data_port(memkv_cli, env, ops_key) -> None:
    good = as_json(memkv_cli("status", "--json", env=env))
    assert good["ok"] is True and good["servers"][0]["auth"] == "ok"
    proc = memkv_cli("status", "--json", env={**env, "MEMKV_AUTH_KEY": WRONG})
    doc = as_json(proc)
    row = doc["servers"][0]
    assert proc.returncode == 1 and doc["ok"] is False
    assert (row["health"], row["auth"]) == ("auth failed", "failed") and "authentication failed" in row["data_error"]
    text = memkv_cli("status", env={**env, "MEMKV_AUTH_KEY": WRONG, "COLUMNS": "200"})
    assert (
        text.returncode == 1
        and "AUTH FAILED" in text.stdout.decode()
        and "authentication failed" in text.stderr.decode()
    )
    assert WRONG.encode() not in text.stdout + text.stderr and ops_key.encode() not in text.stdout + text.stderr


def test_status_names_stored_and_allocated_bytes(memkv_cli, env) -> None:
    assert memkv_cli("put", "truth/sized", "-", stdin=b"s" * 100_000, env=env).returncode == 0
    doc = as_json(memkv_cli("status", "--json", env=env))
    row = doc["servers"][0]
    assert row["allocated_bytes"] == row["used_bytes"] >= row["stored_bytes"] >= 100_000
    out = memkv_cli("status", env={**env, "COLUMNS": "200"}).stdout.decode()
    assert "stored / allocated / capacity" in out and "allocated)" in out
    memkv_cli("del", "truth/sized", env=env)


def test_a_client_pointed_at_the_admin_port_is_told_so_at_once(memkv_cli, node, ops_key) -> None:
    started = time.monotonic()
    proc = memkv_cli(
        "probe", "--json", env={"MEMKV_SERVERS": f"{node.host}:{node.admin_port}", "MEMKV_AUTH_KEY": ops_key}
    )
    took = time.monotonic() - started
    doc = as_json(proc)
    error = doc["servers"][0]["error"]
    assert proc.returncode == 1 and "admin port" in error and "data port" in error, error
    assert "timed out" not in error
    assert took < 30  # the process as a whole (interpreter start included), not a timeout assert on the wire


def test_serve_warns_when_capacity_exceeds_the_machines_memory(ops_key) -> None:
    too_big = 2 * host_memory_bytes()
    node = LocalNode(ops_key, capacity=str(too_big), ready_timeout_s=30.0)
    try:
        log = "".join(node.output)
        assert "WARNING" in log and "exceeds this machine's memory" in log, log
    finally:
        node.stop()


def test_ambiguous_units_and_semicolons_are_refused_naming_the_fix(memkv_cli, env) -> None:
    proc = memkv_cli("serve", "--listen", "127.0.0.1:0", "--capacity", "512mb", env=env, timeout_s=30)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "512MiB (binary) or 512MB (decimal)" in err, err
    proc = memkv_cli("probe", env={**env, "MEMKV_SERVERS": "127.0.0.1:9900;127.0.0.1:9901"})
    assert proc.returncode == 2 and "separated by ','" in proc.stderr.decode()


@pytest.mark.parametrize("stores", ["client", "node"])
def test_status_names_the_bytes_held_in_memfds(memkv_cli, ops_nodes, ops_key, stores) -> None:
    """A value the CLI (a same-host client) stores lives in a memfd, the client's or the node's
    own (--shared-memory-stores): `status` says how many of the allocated bytes those are. A
    deleted value's memfd goes (client-written) or waits in the node's pool for the next value
    (node-written): still memory the node holds, and said so."""
    (node,) = ops_nodes(1, extra_args=["--shared-memory-stores", stores, "--shared-memory-spares", "off"])
    env = {"MEMKV_SERVERS": node.address, "MEMKV_AUTH_KEY": ops_key}
    assert memkv_cli("put", "truth/shm", "-", stdin=b"m" * (2 << 20), env=env).returncode == 0
    row = as_json(memkv_cli("status", "--json", env=env))["servers"][0]
    assert row["allocated_bytes"] >= row["shm_bytes"] >= 2 << 20
    out = memkv_cli("status", env={**env, "COLUMNS": "250"}).stdout.decode()
    assert "in memfds" in out
    memkv_cli("del", "truth/shm", env=env)
    row = as_json(memkv_cli("status", "--json", env=env))["servers"][0]
    assert row["shm_bytes"] == (0 if stores == "client" else 2 << 20) == row["allocated_bytes"]
