"""docs/troubleshooting.md quotes every startup error the tier and the node can print.

Behaviour under test:
* every message built at a `raise ConfigError(...)` / `raise StartupError(...)` site of the
  configuration code (memkv/config.py, memkv/license.py, memkv/integrity.py, memkv/cli/,
  memkv_vllm/config.py, memkv_vllm/startup.py), and every hint `explain_probe_failure` appends,
  appears in the page: its longest literal fragment is quoted verbatim (found by reading the
  source, so a new error fails this test until it is documented);
* the probe failures the tier turns into `MemKV tier cannot start: ...` are the ones the page
  shows: real failures against real nodes on 127.0.0.1 (nothing listening, a wrong key, a full
  node, a name that does not resolve), worded by the tier's own `explain_probe_failure` (taken
  from startup.py's source, since importing memkv_vllm's modules needs vLLM), match one of the page's
  `MemKV tier cannot start:` templates with `<...>` as wildcards.
"""

from __future__ import annotations

import ast
import re
import socket

import pytest

from memkv import errors
from memkv.client.cluster import Client
from memkv.config import AuthKey, ClientConfig, ServerAddress
from memkv.errors import MemKVError
from memkv.local import LocalNode, new_key_hex
from tests.ops.helpers import REPO, poll_until

DOC = REPO / "docs" / "troubleshooting.md"
SOURCES = [
    "src/memkv/config.py",
    "src/memkv/license.py",
    "src/memkv/integrity.py",
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "src/memkv/cli").glob("*.py")),
    "src/memkv_vllm/config.py",
    "src/memkv_vllm/startup.py",
]
ERROR_CLASSES = {"ConfigError", "StartupError"}
MIN_FRAGMENT = 8  # shorter literal pieces (": ", " in ") identify nothing


def literal_pieces(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return []


def error_messages() -> list[tuple[str, int, str]]:
    """(file, line, longest literal fragment) of every startup error message in SOURCES."""
    found = []
    for rel in SOURCES:
        tree = ast.parse((REPO / rel).read_text())
        for node in ast.walk(tree):
            message = None
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ERROR_CLASSES
                and node.args
            ):
                message = node.args[0]
            elif isinstance(node, ast.FunctionDef) and node.name == "explain_probe_failure":
                for ret in ast.walk(node):
                    if isinstance(ret, ast.Return) and ret.value is not None:
                        pieces = [p.strip() for p in literal_pieces(ret.value)]
                        pieces = [p for p in pieces if len(p) >= MIN_FRAGMENT]
                        if pieces:
                            found.append((rel, ret.lineno, max(pieces, key=len)))
                continue
            if message is None:
                continue
            pieces = [p.strip() for p in literal_pieces(message) if len(p.strip()) >= MIN_FRAGMENT]
            if pieces:
                found.append((rel, node.lineno, max(pieces, key=len)))
    return found


def explain_probe_failure():
    """startup.py's own `explain_probe_failure`, compiled from its source with memkv.errors."""
    tree = ast.parse((REPO / "src/memkv_vllm/startup.py").read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "explain_probe_failure"]
    namespace = {name: getattr(errors, name) for name in dir(errors) if not name.startswith("_")}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "startup.py", "exec"), namespace)
    return namespace["explain_probe_failure"]


def documented_templates() -> list[re.Pattern]:
    """Every 'MemKV tier cannot start:' line of the page, `<...>` read as a wildcard."""
    patterns = []
    for line in DOC.read_text().splitlines():
        if line.startswith("MemKV tier cannot start:"):
            parts = re.split(r"<[^>]*>", line)
            patterns.append(re.compile(".+?".join(re.escape(p) for p in parts) + r"\Z"))
    return patterns


@pytest.mark.unit
def test_the_source_scan_finds_the_startup_errors() -> None:
    # Guards the scan itself: an empty result would make the next test vacuous.
    files = {f for f, _, _ in error_messages()}
    assert {"src/memkv/config.py", "src/memkv_vllm/config.py", "src/memkv_vllm/startup.py"} <= files
    assert len(error_messages()) >= 40


@pytest.mark.unit
def test_every_startup_error_is_quoted_in_troubleshooting_md() -> None:
    text = DOC.read_text()
    missing = [f"{f}:{line}: {frag!r}" for f, line, frag in error_messages() if frag not in text]
    assert not missing, "docs/troubleshooting.md does not quote these startup errors:\n" + "\n".join(missing)


def pings(client: Client) -> bool:
    try:
        client._nodes[0].ping()
        return True
    except MemKVError:
        return False


def probe_failure(address: ServerAddress, key_hex: str) -> MemKVError:
    config = ClientConfig(
        servers=(address,), auth_key=AuthKey.from_hex(key_hex, "test"), connect_timeout_s=2.0, io_timeout_s=2.0
    )
    with Client(config) as client:
        (node,) = client._nodes  # what Startup.probe iterates
        with pytest.raises(MemKVError) as info:
            node.ping()
    return info.value


@pytest.mark.integration
def test_real_probe_failures_read_as_the_page_shows_them(ops_key: str) -> None:
    explain = explain_probe_failure()
    templates = documented_templates()
    assert len(templates) >= 8

    def tier_message(server: ServerAddress, exc: MemKVError) -> str:
        return f"MemKV tier cannot start: server {server.name}: {explain(exc)}"  # as startup.py words it

    failures = []
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        refused = ServerAddress("127.0.0.1", closed.getsockname()[1])
    failures.append((refused, probe_failure(refused, ops_key)))
    unresolvable = ServerAddress("memkv-9.memkv.invalid", 9900)  # .invalid never resolves (RFC 2606)
    failures.append((unresolvable, probe_failure(unresolvable, ops_key)))
    with LocalNode(ops_key, capacity="64MiB", extra_args=["--max-connections", "1"]) as node:
        address = ServerAddress(node.host, node.port)
        failures.append((address, probe_failure(address, new_key_hex())))
        config = ClientConfig(servers=(address,), auth_key=AuthKey.from_hex(ops_key, "test"))
        with Client(config) as holder:  # holds the node's only connection slot
            # The refused handshake above frees its slot when the node's thread ends: retry.
            poll_until(lambda: pings(holder), 10.0, what="the node's connection slot to free up")
            failures.append((address, probe_failure(address, ops_key)))

    kinds = [type(exc).__name__ for _, exc in failures]
    assert kinds == ["ConnectError", "ConnectError", "AuthError", "ServerError"], kinds
    unmatched = [msg for msg in (tier_message(s, e) for s, e in failures) if not any(t.match(msg) for t in templates)]
    assert not unmatched, "docs/troubleshooting.md shows no template for:\n" + "\n".join(unmatched)
