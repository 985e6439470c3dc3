"""docs/configuration.md lists exactly the options the code has, with the code's defaults.

Behaviour under test:
* every `memkv serve` flag of the argparse parser (`memkv.cli._parser()`) is in the "Server
  flags" table, and every flag listed there exists; the same for the global flags and for the
  flags of every other subcommand ("Command flags");
* every `MEMKV_*` variable the code reads (config.CLIENT_ENV_VARS plus any `"MEMKV_..."` string
  literal in src/) is in the "Environment variables" table, and nothing else is;
* config.YAML_KEYS and the client.yaml table agree; memkv_vllm.config.TierSettings' fields and
  the tier-key table agree;
* a default written as a lone code span (`8`, `"xxh3"`, `127.0.0.1:9900`) equals the code's
  default (argparse default, dataclass default); a setting whose code default is computed or
  empty is described in words instead.

Pure parsing of the docs and introspection of the code: no processes, no sockets.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re

import pytest
import yaml

from memkv import cli, config
from memkv_vllm.config import TierSettings
from tests.ops.helpers import REPO

pytestmark = pytest.mark.unit

DOC = REPO / "docs" / "configuration.md"
CODE_SPAN = re.compile(r"`([^`]*)`")


# --------------------------------------------------------------------------------------------
# Reading the doc
# --------------------------------------------------------------------------------------------


def doc_sections() -> dict[str, str]:
    """'## Heading' -> body, for every second-level section."""
    sections: dict[str, str] = {}
    current = None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
    return sections


def section(title_start: str) -> str:
    matches = [body for title, body in doc_sections().items() if title.startswith(title_start)]
    assert len(matches) == 1, f"docs/configuration.md needs exactly one section starting with '## {title_start}'"
    return matches[0]


def table_rows(body: str) -> list[list[str]]:
    """Cells of every row of the first markdown table in `body`, without header/separator."""
    rows, in_table = [], False
    for line in body.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not in_table:
                in_table = True  # the header row
                continue
            if all(set(c) <= set("-: ") for c in cells):
                continue
            rows.append(cells)
        elif in_table:
            break
    return rows


def documented(rows: list[list[str]], name_col: int = 0, default_col: int = 1) -> dict[str, str]:
    """Option name -> default cell. A name cell may list aliases: "`-o`, `--output`"."""
    out = {}
    for row in rows:
        names = CODE_SPAN.findall(row[name_col])
        assert names, f"a row without a `code` option name: {row}"
        for name in names:
            assert name not in out, f"{name} is documented twice"
            out[name] = row[default_col]
    return out


# --------------------------------------------------------------------------------------------
# Reading the code
# --------------------------------------------------------------------------------------------


@pytest.fixture
def parser(monkeypatch) -> argparse.ArgumentParser:
    monkeypatch.delenv(cli.ENV_LOG_LEVEL, raising=False)  # --log-level's default reads it
    return cli._parser()


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def flag_defaults(parser: argparse.ArgumentParser) -> dict[str, object]:
    """Every option string but -h/--help -> its default."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        for opt in action.option_strings:
            out[opt] = action.default
    return out


def code_env_vars() -> set[str]:
    """CLIENT_ENV_VARS plus every "MEMKV_..." string literal under src/."""
    names = set(config.CLIENT_ENV_VARS) | {cli.ENV_LOG_LEVEL}
    for path in (REPO / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.fullmatch(r"MEMKV_[A-Z0-9_]+", node.value)
            ):
                names.add(node.value)
    return names


def dataclass_defaults(cls) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = None  # computed: described in words
    return out


def _no_value(default: object) -> bool:
    """Defaults that are computed or empty: the doc describes them in words."""
    return default is None or default is False or default is argparse.SUPPRESS or default in ("", [], ())


def check_default(name: str, cell: str, code_default: object) -> str | None:
    """None when the documented default agrees with the code, else a complaint."""
    spans = CODE_SPAN.findall(cell)
    if len(spans) == 1 and cell.strip() == f"`{spans[0]}`":
        value = yaml.safe_load(spans[0]) if spans[0] else ""
        if value != code_default:
            return f"{name}: documented default `{spans[0]}` but the code's default is {code_default!r}"
        return None
    if not _no_value(code_default):
        return f"{name}: the code's default is {code_default!r}; write it as a lone code span, not {cell!r}"
    return None


def compare(kind: str, in_code: set[str], in_doc: set[str]) -> None:
    missing, extra = sorted(in_code - in_doc), sorted(in_doc - in_code)
    assert not missing and not extra, (
        f"docs/configuration.md and the code disagree on {kind}: "
        f"undocumented {missing}; documented but not in the code {extra}"
    )


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_the_doc_tables_are_found_and_not_empty() -> None:
    # Guards the parser of this file: an empty parse would make the other tests vacuous.
    assert len(table_rows(section("Server flags"))) >= 10
    assert len(table_rows(section("Command flags"))) >= 10
    assert len(table_rows(section("Environment variables"))) >= 9
    assert len(table_rows(section("client.yaml keys"))) >= 12
    assert len(table_rows(section("Tier keys"))) >= 7


def test_every_serve_flag_is_documented_with_its_default_and_nothing_else(parser) -> None:
    code = flag_defaults(subparsers(parser)["serve"])
    doc = documented(table_rows(section("Server flags")))
    compare("`memkv serve` flags", set(code), set(doc))
    problems = [p for name in code if (p := check_default(name, doc[name], code[name]))]
    assert not problems, problems


def test_global_flags_are_documented(parser) -> None:
    code = flag_defaults(parser)
    doc = documented(table_rows(section("Global flags")))
    compare("global flags", set(code), set(doc))
    problems = [p for name in code if (p := check_default(name, doc[name], code[name]))]
    assert not problems, problems


def test_every_flag_of_every_other_command_is_documented_with_its_default(parser) -> None:
    code = {
        (cmd, opt): default
        for cmd, sub in subparsers(parser).items()
        if cmd != "serve"
        for opt, default in flag_defaults(sub).items()
    }
    doc: dict[tuple[str, str], str] = {}
    for row in table_rows(section("Command flags")):
        (cmd,) = CODE_SPAN.findall(row[0])
        for opt in CODE_SPAN.findall(row[1]):
            assert (cmd, opt) not in doc, f"{cmd} {opt} is documented twice"
            doc[(cmd, opt)] = row[2]
    compare("command flags", {f"{c} {o}" for c, o in code}, {f"{c} {o}" for c, o in doc})
    problems = [p for key in code if (p := check_default(f"{key[0]} {key[1]}", doc[key], code[key]))]
    assert not problems, problems


def test_every_memkv_environment_variable_is_documented_and_nothing_else() -> None:
    doc = documented(table_rows(section("Environment variables")))
    compare("MEMKV_* environment variables", code_env_vars(), set(doc))


def test_every_client_yaml_key_is_documented_with_its_default() -> None:
    doc = documented(table_rows(section("client.yaml keys")))
    compare("client.yaml keys", set(config.YAML_KEYS), set(doc))
    defaults = dataclass_defaults(config.ClientConfig)
    problems = [p for key in config.YAML_KEYS if key in defaults and (p := check_default(key, doc[key], defaults[key]))]
    assert not problems, problems


def test_every_tier_key_is_documented_with_its_default() -> None:
    doc = documented(table_rows(section("Tier keys")))
    defaults = dataclass_defaults(TierSettings)
    compare("memkv tier keys", set(defaults), set(doc))
    problems = [p for key in defaults if (p := check_default(key, doc[key], defaults[key]))]
    assert not problems, problems


def test_the_default_check_catches_a_wrong_default() -> None:
    # The comparison itself, on known cases: a wrong number, a number written in words, and a
    # computed default described in words (fine).
    assert check_default("x", "`9`", 8) is not None
    assert check_default("x", "eight", 8) is not None
    assert check_default("x", "`8`", 8) is None
    assert check_default("x", "`5`", 5.0) is None
    assert check_default("x", '`""`', "") is None
    assert check_default("x", "a quarter of RAM", None) is None
    assert check_default("x", "off", False) is None
