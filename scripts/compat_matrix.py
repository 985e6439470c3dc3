"""Run the conformance suite on every vLLM release and record the matrix in docs/compatibility.md.

    python3 -m pip install nox==2026.10.20
    python3 scripts/compat_matrix.py [--reuse] [--direct] [RELEASE ...]

Each release runs in its own nox session (`conformance-<release>`, built from the package
index on first use, ~1 minute and ~2 GB each). The table between the markers in
docs/compatibility.md is replaced with this run's results, with machine, date and commit. A
second column counts the connector layer alone (tests/conformance/test_connector_*.py: vLLM's
real OffloadingConnector driving the tier), read from pytest's JUnit XML. `--direct` runs only
direct mode's tests (`-k direct`: tests/conformance/test_direct_*.py, both load guarantees) and
rewrites the direct-mode table instead.
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "compatibility.md"
MARKERS = {False: ("<!-- matrix:begin -->", "<!-- matrix:end -->"),
           True: ("<!-- direct-matrix:begin -->", "<!-- direct-matrix:end -->")}
# "== 50 passed, 1 skipped in 95.20s ==" or, with -q, the same without the rules.
SUMMARY = re.compile(r"^(?:=+ )?(\d+ (?:passed|failed|error|skipped|deselected).*?) in ([\d.]+)s", re.M)
CONNECTOR_LAYER = "tests.conformance.test_connector_"  # JUnit classname prefix of its test files


def releases() -> list[str]:
    sys.path.insert(0, str(ROOT))
    import noxfile

    return list(noxfile.VLLM_RELEASES)


def connector_layer(junit_xml: Path) -> str:
    """'9 passed, 1 xfailed' for the connector layer's test cases in a JUnit XML report."""
    try:
        cases = ET.parse(junit_xml).getroot().iter("testcase")
    except (OSError, ET.ParseError):
        return "no report"
    counts: Counter[str] = Counter()
    for case in cases:
        if not case.get("classname", "").startswith(CONNECTOR_LAYER):
            continue
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        counts[outcome] += 1
    order = ("passed", "failed", "xfailed", "skipped")
    return ", ".join(f"{counts[k]} {k}" for k in order if counts[k]) or "none ran"


def run(release: str, reuse: bool, direct: bool) -> tuple[str, str, str, float]:
    cmd = [sys.executable, "-m", "nox", "-s", f"conformance-{release}"]
    if reuse:
        cmd.insert(3, "-R")
    with tempfile.TemporaryDirectory() as tmp:
        junit_xml = Path(tmp) / "junit.xml"
        cmd += ["--", "-q", "-p", "no:cacheprovider", f"--junitxml={junit_xml}"]
        if direct:
            cmd += ["-k", "direct"]
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        connector = connector_layer(junit_xml)
    found = SUMMARY.findall(proc.stdout + proc.stderr)
    summary = found[-1][0] if found else "no pytest summary"
    verdict = "PASS" if proc.returncode == 0 else "FAIL"
    return verdict, summary, connector, time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reuse", action="store_true", help="reuse existing nox venvs (skip installs)")
    ap.add_argument("--direct", action="store_true", help="only direct mode's tests; rewrites the direct-mode table")
    ap.add_argument("release", nargs="*")
    args = ap.parse_args()
    chosen = args.release or releases()
    rows = []
    for release in chosen:
        verdict, summary, connector, took = run(release, args.reuse, args.direct)
        layer = "" if args.direct else f"; connector layer: {connector}"
        print(f"{release}: {verdict} ({summary}{layer}) {took:.0f}s", flush=True)
        rows.append(f"| {release} | {verdict} | {summary} |" + ("" if args.direct else f" {connector} |"))
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    machine = f"{platform.machine()}, {platform.system()} {platform.release()}, Python {platform.python_version()}"
    commit = subprocess.run(["git", "log", "-1", "--format=%h"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    how = "`scripts/compat_matrix.py --direct`" if args.direct else "`scripts/compat_matrix.py`"
    header = ["| vLLM | result | direct-mode tests |", "|---|---|---|"] if args.direct else [
        "| vLLM | result | tests | of which the connector layer |", "|---|---|---|---|"]
    table = "\n".join([
        f"Run {stamp} on {machine}, commit {commit or 'unknown'}, by {how} (torch 2.13.0 CPU build, vLLM installed `--no-deps`).",
        "",
        *header,
        *rows,
    ])
    BEGIN, END = MARKERS[args.direct]
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:start] + "\n" + table + "\n" + text[end:])
    sys.exit(0 if all("| PASS |" in r for r in rows) else 1)


if __name__ == "__main__":
    main()
