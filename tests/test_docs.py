"""The docs are reference pages: each at most 400 lines (a longer page holds two subjects, or a
journal the git log keeps), and every link between them lands on a page and a heading that
exist (a page split or a heading renamed breaks none)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
MAX_LINES = 400
LINK = re.compile(r"\]\((?!https?:)([^)#\s]*\.md)?(?:#([^)\s]+))?\)")
LINKED = [REPO / "README.md"] + sorted(DOCS.glob("*.md"))


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_anchor(m[1]) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def _broken_links(page: Path, root: Path = REPO) -> list[str]:
    broken = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for match in LINK.finditer(line):
            target, anchor = match[1], match[2]
            if target is None and anchor is None:
                continue
            linked = (page.parent / target).resolve() if target else page
            if not linked.is_file():
                broken.append(f"{page.relative_to(root)}:{number}: no page {target}")
            elif anchor and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(root)}:{number}: no heading #{anchor} in "
                              f"{linked.relative_to(root)}")
    return broken


def test_every_page_is_at_most_400_lines():
    pages = sorted(DOCS.glob("*.md"))
    assert len(pages) > 10
    long = {p.name: n for p in pages if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"over {MAX_LINES} lines: {long}"


def test_every_link_between_the_pages_lands():
    broken = [b for page in LINKED for b in _broken_links(page)]
    assert broken == [], "\n".join(broken)


def test_the_anchor_rule_and_a_broken_link(tmp_path):
    assert _anchor("From an OVERLAP action to a node: 10 calls deep") == \
        "from-an-overlap-action-to-a-node-10-calls-deep"
    assert _anchor("The demo's `model`") == "the-demos-model"
    page = tmp_path / "a.md"
    (tmp_path / "c.md").write_text("## The `c` page\n")
    page.write_text("# Top\n[ok](#top) [gone](#nowhere) [away](b.md) [c](c.md#the-c-page)\n"
                    "[web](https://example.com/x.md#y) [c](c.md#other)\n")
    assert _broken_links(page, tmp_path) == [
        "a.md:2: no heading #nowhere in a.md", "a.md:2: no page b.md",
        "a.md:3: no heading #other in c.md"]
