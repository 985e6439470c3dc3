"""The operator commands against real nodes: output, `--json` shape and exit codes.

Behaviour under test (exit codes: 0 success, 1 the operation failed, 2 bad usage/config):
* `keygen` prints a fresh 64-hex key (and `{"ok", "auth_key"}` with --json);
* `probe` exits 0 when every server answers with the key, 1 naming a dead server or a wrong
  key (never printing the key), with one JSON entry per server;
* `status` shows each node's stored/allocated/capacity, values, hit ratio, evictions and health, plus
  cluster totals; its JSON counts what was really stored and read; a dead node is `down` and
  exits 1; `--lanes` shows the node's lanes;
* `put`/`get`/`del` round-trip a value byte for byte through stdin, stdout and files; a miss, a
  key not deleted, a value that fails its checksum, and a server that is down exit 1 and say
  which; a key over 480 bytes, an unreadable file, an empty value, a bad MEMKV_SERVERS or an
  unknown flag exit 2, with a JSON error document when --json was asked for;
* `bench` verifies its values byte for byte (embedded node or a configured cluster), keeps
  stdout for the report and draws its progress bar on stderr;
* `serve` with no key and nowhere to create one exits 2 with a message naming what to set.

Every node is a real `memkv serve` on 127.0.0.1; every command a real `python -m memkv`.
"""

from __future__ import annotations

import hashlib
import re
import socket

import pytest

from tests.ops.helpers import as_json, poll_until

pytestmark = pytest.mark.integration

HEX64 = re.compile(r"[0-9a-f]{64}")


@pytest.fixture(scope="module")
def cluster(ops_nodes):
    """Two nodes, admin on data port + 1; the second has a lane for keys under `fleet-a/`."""
    first = ops_nodes(1)[0]
    second = ops_nodes(1, extra_args=["--lane", "fleet-a:fleet-a/:0.5"])[0]
    return [first, second]


@pytest.fixture
def env(cluster, ops_key) -> dict[str, str]:
    return {"MEMKV_SERVERS": ",".join(n.address for n in cluster), "MEMKV_AUTH_KEY": ops_key}


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


# --------------------------------------------------------------------------------------------
# keygen, probe
# --------------------------------------------------------------------------------------------


def test_keygen_prints_a_fresh_key_as_text_and_json(memkv_cli) -> None:
    text, doc = memkv_cli("keygen"), memkv_cli("keygen", "--json")
    assert text.returncode == 0 and HEX64.fullmatch(text.stdout.decode().strip())
    parsed = as_json(doc)
    assert doc.returncode == 0 and parsed["ok"] is True and HEX64.fullmatch(parsed["auth_key"])
    assert parsed["auth_key"] != text.stdout.decode().strip()


def test_probe_exits_0_on_a_healthy_cluster_and_1_naming_a_dead_server(memkv_cli, cluster, env, ops_key) -> None:
    ok = memkv_cli("probe", "--json", env=env)
    doc = as_json(ok)
    assert ok.returncode == 0 and doc["ok"] is True
    assert [s["server"] for s in doc["servers"]] == [n.address for n in cluster]
    assert all(s["ok"] and s["rtt_ms"] > 0 and s["max_value_bytes"] == 64 << 20 for s in doc["servers"])
    assert [s["via"] for s in doc["servers"]] == ["shm"] * len(cluster), "nodes on this host offer shared memory"
    socket_only = as_json(memkv_cli("probe", "--json", env={**env, "MEMKV_SHARED_MEMORY": "off"}))
    assert [s["via"] for s in socket_only["servers"]] == ["local"] * len(cluster), "their Unix socket"
    tcp_only = as_json(memkv_cli("probe", "--json", env={**env, "MEMKV_LOCAL_SOCKET": "off"}))
    assert [s["via"] for s in tcp_only["servers"]] == ["tcp"] * len(cluster)

    dead = dead_address()
    failed = memkv_cli("probe", "--json", env={**env, "MEMKV_SERVERS": f"{env['MEMKV_SERVERS']},{dead}"})
    doc = as_json(failed)
    assert failed.returncode == 1 and doc["ok"] is False
    assert [(s["server"], s["ok"]) for s in doc["servers"]] == [(n.address, True) for n in cluster] + [(dead, False)]
    assert "Connection refused" in doc["servers"][-1]["error"]

    text = memkv_cli("probe", env={**env, "MEMKV_SERVERS": dead})
    assert text.returncode == 1 and f"FAIL  {dead}" in text.stdout.decode()


def test_probe_with_a_wrong_key_exits_1_and_never_prints_either_key(memkv_cli, env, ops_key) -> None:
    wrong = "ab" * 32
    proc = memkv_cli("probe", "--json", env={**env, "MEMKV_AUTH_KEY": wrong})
    doc = as_json(proc)
    assert proc.returncode == 1 and not any(s["ok"] for s in doc["servers"])
    assert all("MEMKV_AUTH_KEY" in s["error"] for s in doc["servers"])
    out = proc.stdout + proc.stderr
    assert ops_key.encode() not in out and wrong.encode() not in out


# --------------------------------------------------------------------------------------------
# status
# --------------------------------------------------------------------------------------------


def test_status_json_counts_what_was_stored_and_read(memkv_cli, cluster, env) -> None:
    before = as_json(memkv_cli("status", "--json", env=env))
    value = b"v" * 100_000
    for i in range(6):
        assert memkv_cli("put", f"status/{i}", "-", stdin=value, env=env).returncode == 0
    assert memkv_cli("get", "status/0", env=env).returncode == 0
    assert memkv_cli("get", "status/never-stored", env=env).returncode == 1

    proc = memkv_cli("status", "--json", env=env)
    doc = as_json(proc)
    assert proc.returncode == 0 and doc["ok"] is True
    rows = doc["servers"]
    assert [r["server"] for r in rows] == [n.address for n in cluster]
    for row in rows:
        assert row["health"] == "ok" and row["capacity_bytes"] == 64 << 20
        assert (
            0 <= row["used_bytes"] <= row["capacity_bytes"]
            and row["used_ratio"] == row["used_bytes"] / row["capacity_bytes"]
        )
        for field in (
            "node_id",
            "values",
            "stored_bytes",
            "hits",
            "misses",
            "hit_ratio",
            "evictions",
            "connections",
            "uptime_s",
            "lanes",
        ):
            assert field in row, field
    total = doc["cluster"]
    assert total["servers"] == total["healthy"] == 2
    assert total["values"] - before["cluster"]["values"] == 6
    assert total["stored_bytes"] - before["cluster"]["stored_bytes"] == 6 * len(value)
    assert (total["hits"] - before["cluster"]["hits"], total["misses"] - before["cluster"]["misses"]) == (1, 1)
    assert total["capacity_bytes"] == 2 * (64 << 20)
    assert memkv_cli("del", *[f"status/{i}" for i in range(6)], env=env).returncode == 0


def test_status_table_shows_each_node_and_the_totals(memkv_cli, cluster, env) -> None:
    proc = memkv_cli("status", "--lanes", env={**env, "COLUMNS": "200"})
    out = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr
    for header in ("server", "health", "stored / allocated / capacity", "values", "hit ratio", "evictions"):
        assert header in out
    for node in cluster:
        assert node.address in out
    assert "total" in out and "2/2 ok" in out and "/ 64.0MiB" in out and "/ 128.0MiB" in out
    assert "fleet-a" in out and "default" in out  # --lanes


def test_status_marks_a_dead_node_down_and_exits_1(memkv_cli, env) -> None:
    dead = dead_address()
    proc = memkv_cli("status", "--json", env={**env, "MEMKV_SERVERS": f"{env['MEMKV_SERVERS']},{dead}"})
    doc = as_json(proc)
    assert proc.returncode == 1 and doc["ok"] is False
    assert [r["health"] for r in doc["servers"]] == ["ok", "ok", "down"]
    assert doc["servers"][-1]["server"] == dead and "error" in doc["servers"][-1]
    assert doc["cluster"]["healthy"] == 2
    text = memkv_cli("status", env={**env, "MEMKV_SERVERS": dead})
    assert text.returncode == 1 and "DOWN" in text.stdout.decode() and dead in text.stderr.decode()


# --------------------------------------------------------------------------------------------
# put / get / del
# --------------------------------------------------------------------------------------------


def test_put_get_del_round_trip_a_value_byte_for_byte(memkv_cli, env, tmp_path) -> None:
    value = bytes(range(256)) * 4000  # ~1 MiB, every byte value
    src = tmp_path / "value.bin"
    src.write_bytes(value)
    put = memkv_cli("put", "--json", "cli/round-trip", str(src), env=env)
    doc = as_json(put)
    assert put.returncode == 0 and doc == {
        "ok": True,
        "key": "cli/round-trip",
        "server": doc["server"],
        "bytes": len(value),
    }
    assert doc["server"] in env["MEMKV_SERVERS"].split(",")

    got = memkv_cli("get", "cli/round-trip", env=env)
    assert got.returncode == 0 and got.stdout == value
    out = tmp_path / "out.bin"
    meta = as_json(memkv_cli("get", "--json", "-o", str(out), "cli/round-trip", env=env))
    assert out.read_bytes() == value
    assert meta == {
        "ok": True,
        "key": "cli/round-trip",
        "server": doc["server"],
        "found": True,
        "bytes": len(value),
        "sha256": hashlib.sha256(value).hexdigest(),
        "output": str(out),
    }

    deleted = memkv_cli("del", "--json", "cli/round-trip", env=env)
    assert deleted.returncode == 0
    assert as_json(deleted)["keys"] == [{"key": "cli/round-trip", "server": doc["server"], "result": "deleted"}]
    gone = memkv_cli("get", "--json", "cli/round-trip", env=env)
    assert gone.returncode == 1 and as_json(gone)["found"] is False and as_json(gone)["error"] == "miss"


def test_put_reads_stdin_and_get_reports_a_miss_with_exit_1(memkv_cli, env) -> None:
    assert memkv_cli("put", "cli/stdin", "-", stdin=b"hello\n", env=env).returncode == 0
    assert memkv_cli("get", "cli/stdin", env=env).stdout == b"hello\n"
    miss = memkv_cli("get", "cli/not-there", env=env)
    assert miss.returncode == 1 and miss.stdout == b"" and b"miss" in miss.stderr
    memkv_cli("del", "cli/stdin", env=env)


def test_del_exits_1_unless_every_key_was_deleted(memkv_cli, env) -> None:
    assert memkv_cli("put", "cli/del-me", "-", stdin=b"x", env=env).returncode == 0
    proc = memkv_cli("del", "--json", "cli/del-me", "cli/never-there", env=env)
    doc = as_json(proc)
    assert proc.returncode == 1 and doc["ok"] is False
    assert [(k["key"], k["result"]) for k in doc["keys"]] == [("cli/del-me", "deleted"), ("cli/never-there", "missing")]
    text = memkv_cli("del", "cli/never-there", env=env)
    assert text.returncode == 1 and b"missing" in text.stdout


def test_commands_on_a_down_server_exit_1_and_say_it_is_unreachable(memkv_cli, env) -> None:
    dead_env = {**env, "MEMKV_SERVERS": dead_address()}
    get = memkv_cli("get", "--json", "cli/x", env=dead_env)
    assert get.returncode == 1 and "unreachable" in as_json(get)["error"]
    put = memkv_cli("put", "--json", "cli/x", "-", stdin=b"x", env=dead_env)
    assert put.returncode == 1 and as_json(put)["ok"] is False and "connect failed" in as_json(put)["error"]
    delete = memkv_cli("del", "--json", "cli/x", env=dead_env)
    assert delete.returncode == 1 and as_json(delete)["keys"][0]["result"] == "unreachable"


def test_get_of_a_value_that_fails_its_checksum_says_so_and_exits_1(memkv_cli, cluster, ops_key) -> None:
    from memkv import protocol as p
    from memkv.client.node import NodeConnection
    from memkv.config import ServerAddress
    from memkv.integrity import Checksummer

    node = cluster[0]
    env = {"MEMKV_SERVERS": node.address, "MEMKV_AUTH_KEY": ops_key}
    # Stored with the checksum of other bytes, as if corrupted on the way in.
    value = b"\x00" * 4096
    sums = Checksummer(bytes.fromhex(ops_key))
    conn = NodeConnection(ServerAddress(node.host, node.port), bytes.fromhex(ops_key), 2.0, 2.0)
    try:
        item = p.PutItem(b"cli/corrupt", len(value), sums.algo, sums.compute(b"\x01" * 4096))
        conn.request(p.PutRequest((item,)), [memoryview(value)])
    finally:
        conn.close()
    proc = memkv_cli("get", "--json", "cli/corrupt", env=env)
    doc = as_json(proc)
    assert proc.returncode == 1 and doc["found"] is False and "failed its checksum" in doc["error"]
    assert proc.stdout.count(b"\x00") == 0
    memkv_cli("del", "cli/corrupt", env=env)


@pytest.mark.parametrize("case", ["long-key", "unreadable-file", "bad-servers", "unknown-flag", "empty-value"])
def test_bad_usage_exits_2(memkv_cli, env, tmp_path, case: str) -> None:
    if case == "long-key":
        proc = memkv_cli("get", "--json", "k" * 481, env=env)
        assert as_json(proc) == {"ok": False, "error": "a key must be 1..480 bytes, got 481", "exit_code": 2}
    elif case == "unreadable-file":
        proc = memkv_cli("put", "--json", "cli/k", str(tmp_path / "absent"), env=env)
        assert "cannot read" in as_json(proc)["error"]
    elif case == "bad-servers":
        proc = memkv_cli("status", "--json", env={**env, "MEMKV_SERVERS": "10.0.0.1"})
        assert "MEMKV_SERVERS" in as_json(proc)["error"]
    elif case == "unknown-flag":
        proc = memkv_cli("status", "--no-such-flag", env=env)
        assert b"unrecognized arguments" in proc.stderr
    else:
        proc = memkv_cli("put", "cli/empty", "-", stdin=b"", env=env)
        assert b"empty value" in proc.stderr
    assert proc.returncode == 2


# --------------------------------------------------------------------------------------------
# bench, serve
# --------------------------------------------------------------------------------------------


def test_bench_against_the_configured_cluster_verifies_and_reports_json(memkv_cli, cluster, env) -> None:
    proc = memkv_cli(
        "bench", "--json", "--value-size", "1MiB", "--values", "8", "--rounds", "1", "--threads", "2", env=env
    )
    doc = as_json(proc)
    assert proc.returncode == 0 and doc["ok"] is True and doc["verified"] is True
    assert doc["servers"] == [n.address for n in cluster]
    assert doc["value_bytes"] == 1 << 20 and doc["values"] == 8 and doc["put_gbps"] > 0 and doc["get_gbps"] > 0
    assert b"\x1b[" not in proc.stderr  # no progress bar with --json


def test_bench_draws_its_progress_bar_on_stderr_and_keeps_stdout_for_the_report(memkv_cli) -> None:
    # Embedded node (no MEMKV_SERVERS). TTY_INTERACTIVE makes rich draw as on a terminal.
    proc = memkv_cli(
        "bench",
        "--value-size",
        "1MiB",
        "--values",
        "4",
        "--rounds",
        "2",
        "--threads",
        "1",
        env={"TTY_INTERACTIVE": "1", "TTY_COMPATIBLE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert out.splitlines()[0].startswith("values 1.0MiB x 4") and "verified byte-exact: True" in out
    assert "\x1b" not in out
    assert "embedded node at 127.0.0.1:" in err and "bench" in err and "100%" in err


def test_serve_without_a_key_and_nowhere_to_write_one_exits_2(memkv_cli, tmp_path) -> None:
    not_a_dir = tmp_path / "config-is-a-file"
    not_a_dir.write_text("")
    proc = memkv_cli(
        "serve", "--listen", "127.0.0.1:0", "--capacity", "64MiB", env={"XDG_CONFIG_HOME": str(not_a_dir)}, timeout_s=30
    )
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert "no auth key configured (MEMKV_AUTH_KEY or --key-file)" in err and "memkv keygen" in err
    assert "Traceback" not in err


def test_status_reflects_a_node_that_stops(memkv_cli, ops_nodes, ops_key) -> None:
    (node,) = ops_nodes(1)
    env = {"MEMKV_SERVERS": node.address, "MEMKV_AUTH_KEY": ops_key}
    assert memkv_cli("status", "--json", env=env).returncode == 0
    node.stop()
    poll_until(
        lambda: memkv_cli("status", "--json", env=env).returncode == 1,
        10.0,
        interval_s=0.1,
        what="status to report the stopped node",
    )
