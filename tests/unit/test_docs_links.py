"""Every file that docs/ and README.md point at is in the repository: a
relative Markdown link (`[text](path)`, anchors aside) and a `*.md` path in
the prose, backticked or bare, name a file of the checkout (issue 38:
docs/vllm.md and docs/sglang.md cited "(UPSTREAM.md)", bare, a file that was
never committed; docs/configuration.md a DESIGN.md that is docs/design.md).
A link resolves against the page's folder; a path against the page's folder
or the checkout's root, as the pages write both. Code blocks and URLs are
not read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path ending in .md, backticked or not: `docs/operations.md`, (UPSTREAM.md).
MD_PATH = re.compile(r"(?<![\w/.:-])([A-Za-z0-9_][A-Za-z0-9_./-]*\.md)(?![\w/-])")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:


def missing_targets(page: Path) -> list[str]:
    text = page.read_text()
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # code blocks are not links
    prose = LINK.sub("]", re.sub(r"https?://\S+", "", text))
    missing = []
    for target in LINK.findall(text):
        path = target.split("#", 1)[0]
        if not path or EXTERNAL.match(target):
            continue
        if not (page.parent / path).exists():
            missing.append(f"link ({target})")
    for target in MD_PATH.findall(prose):
        if not any((base / target).exists() for base in (page.parent, ROOT)):
            missing.append(target)
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_md_path_names_a_file_of_the_repository(page: Path):
    assert missing_targets(page) == [], f"{page.relative_to(ROOT)} names files that are not in the repository"


def test_a_page_that_cites_a_missing_file_is_caught(tmp_path: Path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("")
    page.write_text("See [there](there.md#a), [gone](gone.md), `UPSTREAM.md`, (DESIGN.md) and `there.md`;\n"
                    "[web](https://example.com/x.md), https://example.com/y.md.\n```\n[in a block](nowhere.md)\n```\n")
    assert missing_targets(page) == ["link (gone.md)", "UPSTREAM.md", "DESIGN.md"]
