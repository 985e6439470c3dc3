"""README.md tells a first-time user what the code really does by default.

Behaviour under test: the README names the client's defaults with no MEMKV_* variable (the
server address and the key file `memkv serve` writes, both read from memkv.config, not typed
here), the disk the test command needs, and that the bench figure is a median; its two set-up
commands are the ones the docs promise, after a virtual environment; it lists every page of
docs/. Run against real `memkv serve` processes: its cluster recipe (one key made by
`memkv keygen`, given to every node with `--key-file`, exported to the clients) gives a cluster
that `memkv probe` passes, where nodes that made their own keys fail; its Python snippet runs and
checks what the batch calls return; quickstart's `memkv probe` sample names the path the probe
really reports for a node on the same host.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from memkv import cli, config
from tests.ops.helpers import REPO, _free_port_pair, as_json, clean_env, poll_until

pytestmark = pytest.mark.unit

README = (REPO / "README.md").read_text()


def test_readme_names_the_client_defaults_the_code_uses(monkeypatch) -> None:
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", "/home/someone")
    key_path = str(config.default_key_path()).replace("/home/someone", "~")
    assert f"`{config.DEFAULT_HOST}:{config.DEFAULT_PORT}`" in README
    assert f"`{key_path}`" in README and "`$XDG_CONFIG_HOME/memkv/auth.key`" in README
    assert "With no `MEMKV_*` variables set" in README


def test_readme_says_how_much_disk_the_test_command_needs() -> None:
    assert re.search(r"about 9 GB of free disk for the nox environments", README)


def test_readme_labels_the_bench_figure_as_a_median_and_keeps_its_setup_commands() -> None:
    assert "median of its rounds" in README
    assert "```\npython3 -m pip install . && python3 -m memkv bench\n```" in README
    assert (
        "```\npython3 -m pip install nox==2026.10.20 && python3 -m nox -s lint tests conformance-0.25.0 "
        "conformance-0.34.0 conformance-rdma conformance-remote\n```"
    ) in README


def fenced_blocks(text: str, lang: str = "") -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.S | re.M)


def section(title: str) -> str:
    return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_makes_a_virtual_environment_before_the_install() -> None:
    venv = README.index("python3 -m venv .venv && . .venv/bin/activate")
    assert venv < README.index("<!-- main-command -->")
    assert "PEP 668" in README[:venv] and "externally-managed-environment" in README[:venv]


def test_readme_lists_every_page_of_the_docs() -> None:
    listed = section("Documentation")
    pages = sorted(p.relative_to(REPO) for p in (REPO / "docs").glob("*.md"))
    assert [str(p) for p in pages if f"`{p}`" not in listed] == []
    assert "`docs/archive/`" in listed


def test_readme_states_the_nodes_value_bound_and_a_bench_range_with_its_reasons() -> None:
    serve = cli._parser()._subparsers._group_actions[0].choices["serve"]
    default = next(a.default for a in serve._actions if "--max-value-size" in a.option_strings)
    assert f"up to {default[:-3]} MiB" in README and f"`--max-value-size` ({default[:-3]} MiB by default)" in README
    assert "1-64 MiB values" not in README
    words = " ".join(README.split())
    assert re.search(r"on a 2-vCPU VM, put \d\.\d-\d\.\d GB/s and get \d\.\d-\d\.\d GB/s", words)
    assert "starts a fresh node" in words and "share the same few cores" in words


def _cluster_recipe() -> tuple[str, str, list[str], str]:
    """The README's cluster recipe: the keygen line, one node-host serve line, the clients' key."""
    tour = section("A short tour")
    lines = [ln.split("#")[0].strip() for block in fenced_blocks(tour) for ln in block.splitlines()]
    keygen = next(ln for ln in lines if ln.startswith("memkv keygen"))
    serves = [ln for ln in lines if ln.startswith("memkv serve --listen 0.0.0.0:9900")]
    export = next(ln for ln in lines if ln.startswith("export MEMKV_AUTH_KEY="))
    return keygen, serves[0], serves, export


def test_readme_cluster_recipe_gives_every_node_the_one_key(tmp_path: Path, memkv_cli) -> None:
    keygen, serve_line, serves, export = _cluster_recipe()
    key_file = re.fullmatch(r"memkv keygen > (\S+) && chmod 600 \S+", keygen).group(1)
    assert all(f"--key-file {key_file}" in ln for ln in serves), serves
    assert export == f"export MEMKV_AUTH_KEY=$(cat {key_file})"

    made = memkv_cli("keygen")
    assert made.returncode == 0
    (tmp_path / key_file).write_bytes(made.stdout)
    key = made.stdout.decode().strip()

    def start(line: str) -> tuple[subprocess.Popen, str]:
        port = _free_port_pair()
        args = line.replace("0.0.0.0:9900", f"127.0.0.1:{port}").replace("64GiB", "64MiB").split()[1:]
        proc = subprocess.Popen(
            [sys.executable, "-m", "memkv", *args],
            cwd=tmp_path,
            env=clean_env(tmp_path),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return proc, f"127.0.0.1:{port}"

    def probe(servers: list[str]) -> dict:
        return as_json(memkv_cli("probe", "--json", env={"MEMKV_SERVERS": ",".join(servers), "MEMKV_AUTH_KEY": key}))

    started = [start(serve_line), start(serve_line)]
    # A node started the way the README did before: no key given, so it makes its own.
    own_key = start(serve_line.replace(f" --key-file {key_file}", ""))
    try:
        servers = [address for _, address in started]
        doc = poll_until(lambda: (d := probe(servers))["ok"] and d, timeout_s=60, what="both nodes to answer")
        assert [s["server"] for s in doc["servers"]] == servers
        poll_until(
            lambda: any("MEMKV_AUTH_KEY" in s.get("error", "") for s in probe([own_key[1]])["servers"]),
            timeout_s=60,
            what="the node with its own key to answer, refusing the cluster's key",
        )
    finally:
        for proc, _ in [*started, own_key]:
            proc.terminate()
        for proc, _ in [*started, own_key]:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def test_readme_python_snippet_runs_and_checks_what_the_batch_calls_return(tmp_path: Path, ops_nodes, ops_key) -> None:
    (snippet,) = fenced_blocks(README, "python")
    for call in ("batch_put_views", "batch_get_into"):
        assigned = re.search(rf"^\s*(\w+) = client\.{call}\(", snippet, re.M)
        assert assigned, f"the snippet discards what {call} returns"
        assert re.search(rf"^\s*assert all\({assigned.group(1)}\)", snippet, re.M), f"{call}'s result is not checked"
    node = ops_nodes(1)[0]
    run = subprocess.run(
        [sys.executable, "-c", snippet],
        env=clean_env(tmp_path, MEMKV_SERVERS=node.address, MEMKV_AUTH_KEY=ops_key),
        capture_output=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr.decode()


def test_quickstart_probe_sample_names_the_path_probe_reports(ops_nodes, ops_key, memkv_cli) -> None:
    quickstart = (REPO / "docs" / "quickstart.md").read_text()
    sample = re.search(r"^ok +127\.0\.0\.1:9900 .* via=(\w+)$", quickstart, re.M)
    assert sample, "quickstart shows no `memkv probe` output line"
    node = ops_nodes(1)[0]
    doc = as_json(memkv_cli("probe", "--json", env={"MEMKV_SERVERS": node.address, "MEMKV_AUTH_KEY": ops_key}))
    assert [s["via"] for s in doc["servers"]] == [sample.group(1)]
