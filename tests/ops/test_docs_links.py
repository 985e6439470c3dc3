"""Every link in README.md and docs/ resolves inside the repository.

Behaviour under test: a user reading a clone (or the sdist) can follow every reference.
* a Markdown link or image (`[text](target)`, `![alt](target)`) names a file or folder of this
  repository, relative to the page, and its `#anchor`, if any, is a heading of that page;
* no link leaves the repository: no URL (`http://...`, `<https://...>`) as a link target, and no
  path, in a link or in the text, that climbs out of the repository (`../shared/...` from docs/);
* a path written in the text as `../something` resolves to a file of the repository.

Example hosts inside code blocks and code spans (`https://127.0.0.1:9901/v1/health`) are commands
to type, not links, and are not checked. Pure text checks: no processes, no sockets.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.ops.helpers import REPO

pytestmark = pytest.mark.unit

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
AUTOLINK = re.compile(r"<((?:https?|ftp|mailto):[^>\s]+)>")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
UPWARD = re.compile(r"(?<![\w./-])((?:\.\./)+[\w.-][\w./-]*)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation dropped, spaces
    to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for match in HEADING.finditer(FENCE.sub("", page.read_text())):
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def prose(page: Path) -> str:
    """The page without code blocks and code spans: where links live."""
    return CODE_SPAN.sub("", FENCE.sub("", page.read_text()))


def problems(page: Path, root: Path = REPO) -> list[str]:
    found = []
    text = prose(page)
    targets = [m.group(1) for m in LINK.finditer(text)] + [m.group(1) for m in AUTOLINK.finditer(text)]
    for target in targets:
        if not target or SCHEME.match(target):
            found.append(f"{target!r}: a link outside the repository" if target else "an empty link")
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.is_relative_to(root):
            found.append(f"{target!r}: a link outside the repository")
        elif not dest.exists():
            found.append(f"{target!r}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            found.append(f"{target!r}: no heading with that anchor in {dest.relative_to(root)}")
    # Paths written in the text (code spans included) that climb out of the page's folder.
    for match in UPWARD.finditer(FENCE.sub("", page.read_text())):
        written = match.group(1).rstrip(".")
        dest = (page.parent / written).resolve()
        if not dest.is_relative_to(root):
            found.append(f"{written!r}: a path outside the repository")
        elif not dest.exists():
            found.append(f"{written!r}: no such file in the repository")
    return found


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves_inside_the_repository(page: Path) -> None:
    assert problems(page) == []


def test_the_checker_catches_what_it_must(tmp_path: Path) -> None:
    """The checker itself, on a page written to fail in each way it must catch."""
    root = tmp_path / "repo"
    (root / "docs" / "img").mkdir(parents=True)
    (root / "docs" / "configuration.md").write_text("# Configuration\n\n## Tier keys\n")
    (tmp_path / "outside.md").write_text("# Outside\n")
    page = root / "docs" / "probe.md"
    page.write_text(
        "# Probe\n\n## A heading, with `code`\n\n"
        "[ok](#a-heading-with-code) [ok](configuration.md#tier-keys) [ok](img/)\n"
        "[bad](#no-such-heading) [bad](no-such-file.md) [bad](configuration.md#no-such-anchor)\n"
        "[bad](https://example.com/) <https://example.com/> [bad](../../outside.md)\n"
        "See `../shared/ref/limits.md` and ../shared/ref/gpu.md.\n"
        "```\ncurl https://127.0.0.1:9901/v1/health [x](missing.md)\n```\n"
    )
    assert problems(page, root) == [
        "'#no-such-heading': no heading with that anchor in docs/probe.md",
        "'no-such-file.md': no such file in the repository",
        "'configuration.md#no-such-anchor': no heading with that anchor in docs/configuration.md",
        "'https://example.com/': a link outside the repository",
        "'../../outside.md': a link outside the repository",
        "'https://example.com/': a link outside the repository",
        "'../../outside.md': a path outside the repository",
        "'../shared/ref/limits.md': no such file in the repository",
        "'../shared/ref/gpu.md': no such file in the repository",
    ]
