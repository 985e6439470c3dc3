"""docs/performance.md's tables are the benchmarks' JSON, as bench/perf_tables.py writes them.

Behaviour under test: every table of the page is regenerated from its source files and comes out
exactly as written (so a figure cannot drift from the JSON it cites, and a new run is published by
replacing the JSON and rerunning the script); each table's first line names the machine, a date,
the commit and the source files, which exist in the repository; a figure edited by hand is caught.
Pure file reading: no processes, no sockets.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests.ops.helpers import REPO

pytestmark = pytest.mark.unit

spec = importlib.util.spec_from_file_location("perf_tables", REPO / "bench" / "perf_tables.py")
assert spec and spec.loader
perf_tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(perf_tables)

PAGE = (REPO / "docs" / "performance.md").read_text()
BLOCKS = list(perf_tables.BLOCK.finditer(PAGE))


def test_every_table_of_the_page_is_what_its_json_gives() -> None:
    assert sorted(m.group("name") for m in BLOCKS) == sorted(perf_tables.TABLES)
    assert perf_tables.render(PAGE) == PAGE, "docs/performance.md is stale: run python3 bench/perf_tables.py"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda m: m.group("name"))
def test_every_table_names_its_machine_date_commit_and_sources(block) -> None:
    first = block.group("body").splitlines()[0]
    assert re.search(r"the 2-vCPU VM|NVIDIA H[12]00", first), first
    assert re.search(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC", first) and re.search(r"commits? [0-9a-f]{7}", first), first
    sources = re.findall(r"`(bench/[\w./-]+\.json)`", first.split("source:", 1)[1])
    assert sources and all((REPO / s).is_file() for s in sources), sources


def test_a_figure_edited_by_hand_is_caught() -> None:
    edited = PAGE.replace("| 1.000 | yes |", "| 0.900 | yes |", 1)
    assert edited != PAGE
    assert perf_tables.render(edited) == PAGE
