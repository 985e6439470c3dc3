r"""`memkv ls` against three real nodes: output, `--json` shape, key escapes and exit codes.

Behaviour under test (exit codes as for every command: 0 success, 1 the operation failed,
2 bad usage/config):
* `ls PREFIX` prints the keys stored under PREFIX over all three nodes, merged in byte order,
  one line each with the value's size and its server; exit 0;
* binary keys round-trip through the CLI: a key put with `\xNN` / `\\` escapes is listed in the
  same escaped form, and that printed form works as is for `get` and `del`;
* `--json` prints one document: ok, prefix, limit, count, truncated, keys [{key, bytes,
  server}], servers [{server, ok, listed | error}];
* `--limit` cuts the listing and says so (stderr, `truncated`), still exit 0;
* nothing under the prefix exits 1 saying so; a killed node exits 1 naming it (stderr and
  JSON) while the other nodes' keys are still listed; a wrong auth key exits 1 naming
  MEMKV_AUTH_KEY and never printing either key;
* a bad --limit, a prefix over 480 bytes or a bad escape exits 2 before any I/O.

Every node is a real `memkv serve` on 127.0.0.1; every command a real `python -m memkv`.
"""

from __future__ import annotations

import pytest

from tests.ops.helpers import as_json

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(ops_nodes):
    return ops_nodes(3)


@pytest.fixture
def env(cluster, ops_key) -> dict[str, str]:
    return {"MEMKV_SERVERS": ",".join(n.address for n in cluster), "MEMKV_AUTH_KEY": ops_key}


@pytest.fixture(scope="module")
def stored(cluster, ops_key) -> dict[bytes, tuple[int, str]]:
    """Keys under `ls/` put through the client, spread over the three nodes: key -> (bytes, server)."""
    from memkv import Client, ClientConfig
    from memkv.config import AuthKey, ServerAddress

    keys = {b"ls/%02d" % i: 100 + i for i in range(48)}
    cfg = ClientConfig(
        servers=tuple(ServerAddress(n.host, n.port) for n in cluster), auth_key=AuthKey.from_hex(ops_key, "test")
    )
    with Client(cfg) as client:
        assert all(client.batch_put_views([(k, memoryview(bytes(n))) for k, n in keys.items()]))
        owners = {k: client.owner(k).name for k in keys}
    assert len(set(owners.values())) == 3, "the keys should spread over every node"
    return {k: (n, owners[k]) for k, n in keys.items()}


def test_ls_prints_the_keys_under_a_prefix_merged_over_three_nodes_with_size_and_server(memkv_cli, env, stored) -> None:
    proc = memkv_cli("ls", "ls/", env=env)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.decode().splitlines()]
    assert lines == [[k.decode(), str(n), server] for k, (n, server) in sorted(stored.items())]
    assert proc.stderr == b""
    narrow = memkv_cli("ls", "ls/1", env=env)
    assert [line.split()[0] for line in narrow.stdout.decode().splitlines()] == [f"ls/1{i}" for i in range(10)]


def test_ls_json_has_the_documented_shape(memkv_cli, env, stored, cluster) -> None:
    proc = memkv_cli("ls", "--json", "ls/2", env=env)
    doc = as_json(proc)
    assert proc.returncode == 0
    expected = [
        {"key": k.decode(), "bytes": n, "server": s} for k, (n, s) in sorted(stored.items()) if k.startswith(b"ls/2")
    ]
    listed = {n.address: sum(1 for e in expected if e["server"] == n.address) for n in cluster}
    assert doc == {
        "ok": True,
        "prefix": "ls/2",
        "limit": 1000,
        "count": len(expected),
        "truncated": False,
        "keys": expected,
        "servers": [{"server": n.address, "ok": True, "listed": listed[n.address]} for n in cluster],
    }


def test_limit_cuts_the_listing_and_says_so_with_exit_0(memkv_cli, env, stored) -> None:
    proc = memkv_cli("ls", "--limit", "5", "ls/", env=env)
    assert proc.returncode == 0
    assert [line.split()[0] for line in proc.stdout.decode().splitlines()] == [k.decode() for k in sorted(stored)[:5]]
    assert b"listing stops at --limit 5: more keys match" in proc.stderr
    doc = as_json(memkv_cli("ls", "--json", "--limit", "5", "ls/", env=env))
    assert doc["ok"] is True and doc["truncated"] is True and doc["count"] == 5 and "error" not in doc


def test_binary_keys_round_trip_through_ls_get_and_del(memkv_cli, env) -> None:
    typed = r"bin/\x00\xff\x20\\end\x0a"  # NUL, 0xff, space, a backslash, newline
    assert memkv_cli("put", typed, "-", stdin=b"binary value", env=env).returncode == 0
    listed = memkv_cli("ls", "bin/", env=env)
    assert listed.returncode == 0
    (line,) = listed.stdout.decode().splitlines()
    printed = line.split()[0]
    assert printed == typed
    doc = as_json(memkv_cli("ls", "--json", r"bin/\x00", env=env))
    assert [k["key"] for k in doc["keys"]] == [typed] and doc["prefix"] == r"bin/\x00"
    got = memkv_cli("get", printed, env=env)
    assert got.returncode == 0 and got.stdout == b"binary value"
    # The printed form is a Python bytes-literal escape, for JSON consumers.
    import codecs

    assert codecs.escape_decode(doc["keys"][0]["key"].encode())[0] == b"bin/\x00\xff \\end\n"
    deleted = memkv_cli("del", printed, env=env)
    assert deleted.returncode == 0 and b"deleted" in deleted.stdout
    assert memkv_cli("ls", "bin/", env=env).returncode == 1


def test_nothing_under_the_prefix_exits_1_and_says_so(memkv_cli, env) -> None:
    text = memkv_cli("ls", "no-such-prefix/", env=env)
    assert text.returncode == 1 and text.stdout == b"" and b'no keys start with "no-such-prefix/"' in text.stderr
    doc = as_json(memkv_cli("ls", "--json", "no-such-prefix/", env=env))
    assert doc["ok"] is False and doc["count"] == 0 and doc["keys"] == [] and "no keys start with" in doc["error"]
    assert all(s["ok"] for s in doc["servers"])


def test_a_killed_node_exits_1_naming_it_and_the_other_nodes_keys_are_still_listed(
    memkv_cli, ops_nodes, ops_key
) -> None:
    nodes = ops_nodes(3)
    env = {"MEMKV_SERVERS": ",".join(n.address for n in nodes), "MEMKV_AUTH_KEY": ops_key}
    for i in range(12):
        assert memkv_cli("put", f"kill/{i:02d}", "-", stdin=b"x" * (i + 1), env=env).returncode == 0
    full = as_json(memkv_cli("ls", "--json", "kill/", env=env))
    assert full["count"] == 12
    victim = nodes[0]
    victim.kill()
    survivors = [k for k in full["keys"] if k["server"] != victim.address]

    text = memkv_cli("ls", "kill/", env=env)
    assert text.returncode == 1
    assert [line.split()[0] for line in text.stdout.decode().splitlines()] == [k["key"] for k in survivors]
    err = text.stderr.decode()
    assert f"server {victim.address} did not answer" in err and "its keys are missing from this listing" in err

    proc = memkv_cli("ls", "--json", "kill/", env=env)
    doc = as_json(proc)
    assert proc.returncode == 1 and doc["ok"] is False and doc["keys"] == survivors
    assert [(s["server"], s["ok"]) for s in doc["servers"]] == [(n.address, n is not victim) for n in nodes]
    assert "connect failed" in doc["servers"][0]["error"] and victim.address in doc["error"]


def test_a_wrong_auth_key_exits_1_naming_the_variable_and_never_printing_a_key(memkv_cli, env, ops_key) -> None:
    wrong = "cd" * 32
    proc = memkv_cli("ls", "--json", env={**env, "MEMKV_AUTH_KEY": wrong})
    doc = as_json(proc)
    assert proc.returncode == 1 and doc["keys"] == [] and not any(s["ok"] for s in doc["servers"])
    assert all("MEMKV_AUTH_KEY" in s["error"] for s in doc["servers"])
    out = proc.stdout + proc.stderr
    assert ops_key.encode() not in out and wrong.encode() not in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--limit", "0"], "--limit must be 1..4096, got 0"),
        (["--limit", "4097"], "--limit must be 1..4096, got 4097"),
        (["p" * 481], "a key prefix must be 0..480 bytes, got 481"),
        ([r"bad\escape"], r'bad escape "\e" in key "bad\escape"'),
    ],
    ids=["limit-0", "limit-4097", "prefix-481-bytes", "bad-escape"],
)
def test_bad_usage_exits_2_before_any_io(memkv_cli, args, message) -> None:
    # No reachable server is configured: a usage error must not even try to connect.
    env = {"MEMKV_SERVERS": "127.0.0.1:1", "MEMKV_AUTH_KEY": "ab" * 32}
    proc = memkv_cli("ls", "--json", *args, env=env)
    doc = as_json(proc)
    assert proc.returncode == 2 and doc["ok"] is False and doc["exit_code"] == 2
    assert doc["error"].startswith(message), doc["error"]
