"""Every query of deploy/grafana/memkv.json names metrics (and labels) that really exist.

Behaviour under test:
* the dashboard is Grafana JSON whose panels all query the `$datasource` Prometheus variable,
  and every query (panel targets and template variables) parses as PromQL;
* every metric name a query selects is exposed by one of the three producers, after real
  traffic: a live `memkv serve` node's /v1/metrics (puts, hits, misses, exists, deletes, a
  refused key, a garbage frame), the client registry `memkv.client.metrics.REGISTRY`
  (prometheus_client.generate_latest, after requests to a live and a dead server), or the
  vLLM tier's declared definitions (memkv_vllm.metrics.metric_definitions(): counters get
  `_total`, histograms `_bucket`/`_sum`/`_count`);
* every label a query matches on or groups by exists on the metrics it applies to (plus the
  target labels `job` and `instance` that Prometheus adds, and `le` on buckets);
* the dashboard covers what operators need: per-lane evictions, auth failures, request latency
  by op, client server-up, and each tier series.
"""

from __future__ import annotations

import re
import socket
import sys
import types
import urllib.request
from collections.abc import Iterator

import promql_parser
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from memkv import Client, ClientConfig
from memkv import protocol as p
from memkv.client import metrics as client_metrics
from memkv.client.node import NodeConnection
from memkv.config import AuthKey, ServerAddress
from memkv.errors import MemKVError
from memkv.local import LocalNode, new_key_hex
from tests.ops.helpers import REPO, poll_until

pytestmark = pytest.mark.integration

DASHBOARD = REPO / "deploy" / "grafana" / "memkv.json"
TARGET_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


# --------------------------------------------------------------------------------------------
# The dashboard
# --------------------------------------------------------------------------------------------


def load_dashboard() -> dict:
    import json

    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows keep their panels inside


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    out = []
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r}", target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q.strip())
            assert m, f"variable {var['name']}: expected label_values(<selector>, <label>), got {q!r}"
            out.append((f"variable {var['name']}", m.group(1)))
            out.append((f"variable {var['name']} label", f"group by ({m.group(2)}) ({m.group(1)})"))
    return out


def substitute_grafana_variables(expr: str) -> str:
    expr = re.sub(r"\$__(rate_interval|interval|range)\b", "5m", expr)
    return re.sub(r"\$\{?\w+\}?", "x", expr)


def selectors_and_groupings(expr: str) -> tuple[list[tuple[str, set[str]]], list[tuple[set[str], set[str]]]]:
    """([(metric name, matcher labels)], [(grouping labels, metric names inside)])."""
    ast = promql_parser.parse(substitute_grafana_variables(expr))
    selectors: list[tuple[str, set[str]]] = []
    groupings: list[tuple[set[str], set[str]]] = []

    def names_under(node) -> set[str]:
        found: set[str] = set()

        def visit(n):
            if isinstance(n, promql_parser.VectorSelector):
                found.add(n.name)
            return True

        promql_parser.walk(node, visit)
        return found

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            labels = {m.name for m in node.matchers.matchers} - {"__name__"}
            selectors.append((node.name, labels))
        elif (
            isinstance(node, promql_parser.AggregateExpr)
            and node.modifier is not None
            and node.modifier.type == promql_parser.AggModifierType.By
        ):
            groupings.append((set(node.modifier.labels), names_under(node.expr)))
        return True

    promql_parser.walk(ast, visit)
    return selectors, groupings


# --------------------------------------------------------------------------------------------
# The producers
# --------------------------------------------------------------------------------------------


def exposition_labels(text: str) -> dict[str, set[str] | None]:
    """Sample name -> label names seen (None: declared, no sample yet). A declared family with
    no samples still counts as existing, under the names Prometheus will see once it has one."""
    out: dict[str, set[str] | None] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            out.setdefault(family.name + suffix, None)
        for sample in family.samples:
            labels = out.get(sample.name) or set()
            out[sample.name] = labels | set(sample.labels)
    return out


def node_traffic(node: LocalNode, key_hex: str) -> None:
    """Real traffic that makes every node series appear: puts, hits, misses, exists, deletes,
    an auth failure (wrong key), a connection error (garbage frame after a good handshake)."""
    address = ServerAddress(node.host, node.port)
    cfg = ClientConfig(servers=(address,), auth_key=AuthKey.from_hex(key_hex, "test"))
    with Client(cfg) as client:
        client.put(b"dash/a", b"x" * 4096)
        client.batch_put_views([(b"dash/b", memoryview(bytearray(2 << 20)))])
        assert client.get(b"dash/a") is not None and client.get(b"dash/missing") is None
        client.exists([b"dash/a", b"dash/missing"])
        client.delete([b"dash/b"])
    wrong = ClientConfig(servers=(address,), auth_key=AuthKey.from_hex(new_key_hex(), "wrong"))
    with Client(wrong) as client, pytest.raises(MemKVError):
        client.probe()
    conn = NodeConnection(address, bytes.fromhex(key_hex), 2.0, 2.0)
    try:
        conn.sock.sendall(b"\xff" * p.FRAME_PREFIX_BYTES)  # not a frame: the node answers ERROR and closes
        conn.sock.settimeout(5.0)
        try:
            while conn.sock.recv(4096):
                pass
        except OSError:
            pass
    finally:
        conn.close()


def scrape(node: LocalNode) -> str:
    with urllib.request.urlopen(f"{node.admin_url}/v1/metrics", timeout=5) as resp:
        return resp.read().decode()


@pytest.fixture(scope="module")
def node_series(ops_key: str) -> dict[str, set[str] | None]:
    node = LocalNode(ops_key, capacity="64MiB", extra_args=["--lane", "fleet-a:fleet-a/:0.5"])
    try:
        node_traffic(node, ops_key)

        def with_error_series() -> str | None:
            text = scrape(node)
            return text if "memkv_node_errors_total{" in text and "memkv_node_auth_failures_total{" in text else None

        text = poll_until(with_error_series, 10.0, what="error and auth-failure series on /v1/metrics")
        return exposition_labels(text)
    finally:
        node.stop()


@pytest.fixture(scope="module")
def client_series(ops_key: str) -> dict[str, set[str] | None]:
    node = LocalNode(ops_key, capacity="64MiB")
    try:
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            dead = ServerAddress("127.0.0.1", closed.getsockname()[1])
        cfg = ClientConfig(
            servers=(ServerAddress(node.host, node.port), dead),
            auth_key=AuthKey.from_hex(ops_key, "test"),
            connect_timeout_s=1.0,
            io_timeout_s=2.0,
        )
        with Client(cfg) as client:
            keys = [f"dash/client/{i}".encode() for i in range(16)]
            client.batch_put_views([(k, memoryview(bytearray(1 << 20))) for k in keys])
            client.batch_get_into([(k, memoryview(bytearray(1 << 20))) for k in keys])
            client.exists(keys)
            client.delete(keys)
            client.get(b"dash/client/missing")
            # A value whose bytes do not match its checksum (as if corrupted on the way): the
            # reader's verification fails and counts it.
            corrupt = next(
                f"dash/corrupt/{i}".encode() for i in range(1000) if client.owner(f"dash/corrupt/{i}").port == node.port
            )
            conn = NodeConnection(ServerAddress(node.host, node.port), bytes.fromhex(ops_key), 2.0, 2.0)
            try:
                value = memoryview(bytes(4096))
                item = p.PutItem(
                    corrupt, len(value), client.checksummer.algo, client.checksummer.compute(memoryview(b"\x01" * 4096))
                )
                conn.request(p.PutRequest((item,)), [value])
            finally:
                conn.close()
            assert client.batch_get_into([(corrupt, memoryview(bytearray(4096)))]) == [False]
    finally:
        node.stop()
    return exposition_labels(generate_latest(client_metrics.REGISTRY).decode())


@pytest.fixture(scope="module")
def tier_series() -> dict[str, set[str] | None]:
    """The tier's declared metric definitions, with the standard name suffixes. Without vLLM,
    memkv_vllm.compat (the only module that imports it) is stood in for by the two metadata
    classes metric_definitions() uses, with vLLM's signature."""
    from memkv_vllm import metrics as tier_metrics

    try:
        import vllm  # noqa: F401
    except ImportError:

        class _Meta:
            def __init__(self, documentation: str, labelnames: tuple[str, ...] = (), buckets=None) -> None:
                self.documentation, self.labelnames, self.buckets = documentation, tuple(labelnames), buckets

        stand_in = types.ModuleType("memkv_vllm.compat")
        stand_in.OffloadingCounterMetadata = type("OffloadingCounterMetadata", (_Meta,), {})
        stand_in.OffloadingHistogramMetadata = type("OffloadingHistogramMetadata", (_Meta,), {})
        saved = sys.modules.get("memkv_vllm.compat")
        sys.modules["memkv_vllm.compat"] = stand_in
        try:
            definitions = tier_metrics.metric_definitions()
        finally:
            if saved is None:
                del sys.modules["memkv_vllm.compat"]
            else:
                sys.modules["memkv_vllm.compat"] = saved
    else:
        definitions = tier_metrics.metric_definitions()
    out: dict[str, set[str] | None] = {}
    for name, meta in definitions.items():
        kind = (
            "histogram"
            if "Histogram" in type(meta).__name__
            else "counter"
            if "Counter" in type(meta).__name__
            else "gauge"
        )
        for suffix in SUFFIXES.get(kind, ("",)):
            out[name + suffix] = set(meta.labelnames) | ({"le"} if suffix == "_bucket" else set())
    return out


@pytest.fixture(scope="module")
def known(node_series, client_series, tier_series) -> dict[str, set[str] | None]:
    merged: dict[str, set[str] | None] = {}
    for series in (node_series, client_series, tier_series):
        for name, labels in series.items():
            if name in merged and merged[name] is not None and labels is not None:
                merged[name] = merged[name] | labels
            elif name not in merged or merged[name] is None:
                merged[name] = labels
    return merged


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_every_panel_queries_the_prometheus_datasource_variable() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"]
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert "datasource" in names
    panels = [pl for pl in all_panels(dashboard) if pl["type"] != "row"]
    assert len(panels) >= 25
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
    assert len({pl["id"] for pl in all_panels(dashboard)}) == len(list(all_panels(dashboard))), (
        "panel ids must be unique"
    )


def test_every_query_parses_as_promql() -> None:
    bad = []
    for where, expr in queries(load_dashboard()):
        try:
            promql_parser.parse(substitute_grafana_variables(expr))
        except Exception as exc:  # the parser raises its own error types
            bad.append(f"{where}: {expr}: {exc}")
    assert not bad, "\n".join(bad)


def test_every_metric_in_the_dashboard_exists_in_a_real_exposition(
    known, node_series, client_series, tier_series
) -> None:
    # The producers themselves first: an empty scrape would make the check vacuous.
    assert "memkv_node_capacity_bytes" in node_series and "memkv_client_requests_total" in client_series
    assert "vllm:kv_offload_memkv_lookups_total" in tier_series
    missing = []
    for where, expr in queries(load_dashboard()):
        selectors, _ = selectors_and_groupings(expr)
        missing += [f"{where}: {name}" for name, _ in selectors if name not in known]
    assert not missing, "metrics no producer exposes:\n" + "\n".join(sorted(set(missing)))


def test_every_label_in_the_dashboard_exists_on_its_metric(known) -> None:
    problems = []
    for where, expr in queries(load_dashboard()):
        selectors, groupings = selectors_and_groupings(expr)
        for name, labels in selectors:
            have = known.get(name)
            if have is not None and labels - have - TARGET_LABELS:
                problems.append(
                    f"{where}: {name} has no label {sorted(labels - have - TARGET_LABELS)} (has {sorted(have)})"
                )
        for by, names in groupings:
            have = set().union(*(known.get(n) or set() for n in names)) if names else set()
            if by - have - TARGET_LABELS:
                problems.append(
                    f"{where}: grouping by {sorted(by - have - TARGET_LABELS)}, which {sorted(names)} do not carry"
                )
    assert not problems, "\n".join(problems)


def test_the_dashboard_covers_what_operators_need() -> None:
    exprs = " ".join(expr for _, expr in queries(load_dashboard()))
    needed = [
        "memkv_node_capacity_bytes",
        "memkv_node_allocated_bytes",
        "memkv_node_values",
        "memkv_node_evictions_total",
        "memkv_node_requests_total",
        "memkv_node_request_seconds_bucket",
        "memkv_node_auth_failures_total",
        "memkv_node_connections",
        "memkv_client_requests_total",
        "memkv_client_server_up",
        "vllm:kv_offload_memkv_store_bytes_total",
        "vllm:kv_offload_memkv_load_bytes_total",
        "vllm:kv_offload_memkv_job_seconds_bucket",
        "vllm:kv_offload_memkv_jobs_failed_total",
        "vllm:kv_offload_memkv_sheds_total",
        "vllm:kv_offload_memkv_lookups_total",
    ]
    assert not [n for n in needed if n not in exprs]
    assert "sum by (lane) (rate(memkv_node_evictions_total" in exprs
    assert "sum by (result) (rate(vllm:kv_offload_memkv_lookups_total" in exprs


def test_the_check_rejects_an_invented_metric(known) -> None:
    selectors, _ = selectors_and_groupings('sum(rate(memkv_node_imaginary_total{job=~"$node_job"}[$__rate_interval]))')
    assert [n for n, _ in selectors if n not in known] == ["memkv_node_imaginary_total"]
