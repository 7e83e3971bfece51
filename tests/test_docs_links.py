"""README.md is the front door and docs/ the reference: every relative link between them resolves to a file of the
repository and, with an anchor, to a heading of that file; every docs page is reachable from the README."""

import re

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 350  # issue 17: the reference lives in docs/


def _prose(text):
    """The text outside fenced code blocks and inline code, where a `[x](y)` is a link."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(text):
    """The anchors GitHub gives the headings of a markdown text, duplicates numbered -1, -2…"""
    seen, found = {}, set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(page, root=ROOT):
    """Every relative link of `page` whose file or heading does not exist, as 'target: why'."""
    problems = []
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", _prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not the repository's
            continue
        path, _hash, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if root.resolve() not in dest.parents or not dest.is_file():
            problems.append(f"{target}: no such file in the repository")
        elif anchor and anchor not in anchors(dest.read_text(encoding="utf-8")):
            problems.append(f"{target}: no heading #{anchor} in {dest.name}")
    return problems


def test_every_relative_link_of_the_readme_and_docs_resolves():
    problems = {page.relative_to(ROOT).as_posix(): broken_links(page) for page in PAGES}
    assert {page: found for page, found in problems.items() if found} == {}


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The `model_call` event\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#the-model_call-event) [self](#title) [web](https://example.org/x#y)\n"
                    "[gone](missing.md) [bad anchor](other.md#nothing) `[code](missing.md)`\n\n# Title\n\n"
                    "```\n[in a block](missing.md)\n```\n", encoding="utf-8")
    assert broken_links(page, root=tmp_path) == ["missing.md: no such file in the repository",
                                                 "other.md#nothing: no heading #nothing in other.md"]
    assert anchors("# A b\n## A b\n```\n# not a heading\n```\n") == {"a-b", "a-b-1"}


def test_the_readme_fits_its_budget_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.count("\n") <= README_MAX_LINES
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)[#)]", readme))
    assert {page.relative_to(ROOT).as_posix() for page in PAGES[1:]} <= linked
