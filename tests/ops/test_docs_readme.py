"""README.md tells a first-time user what the code really does by default.

Behaviour under test: the README names the client's defaults with no MEMKV_* variable (the
server address and the key file `memkv serve` writes, both read from memkv.config, not typed
here), the disk the test command needs, and that the bench figure is a median; its two set-up
commands are the ones the docs promise. Pure text checks: no processes, no sockets.
"""

from __future__ import annotations

import re

import pytest

from memkv import config
from tests.ops.helpers import REPO

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
    assert re.search(r"about 7 GB of free disk for the nox environments", README)


def test_readme_labels_the_bench_figure_as_a_median_and_keeps_its_setup_commands() -> None:
    assert "median of its rounds" in README
    assert "```\npython3 -m pip install . && python3 -m memkv bench\n```" in README
    assert ("```\npython3 -m pip install nox==2026.10.20 && python3 -m nox -s lint tests conformance-0.25.0 "
            "conformance-0.34.0 conformance-rdma\n```") in README
