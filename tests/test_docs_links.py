"""Every link in the README, the changelog and docs/ stays inside the repository and resolves.

The docs are read in a checkout, an unpacked sdist and on a code host alike: a link to a file
beside the repository (the old ``../shared/SPEC.md``) or to a web page breaks in some of them, so
none is allowed. Anchors (``#section``) must name a heading of their target.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
# [text](target), [text]: target (reference definitions), <scheme:...> autolinks, bare URLs.
INLINE = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
AUTOLINK = re.compile(r"<([a-zA-Z][\w+.-]*:[^>\s]+)>")
BARE_URL = re.compile(r"\b(?:https?|ftp)://\S+|\bwww\.\S+")


def without_code(text: str) -> str:
    """Markdown outside code blocks and inline code, where a link is a link."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(markdown: Path) -> set[str]:
    """GitHub's anchor for each heading: lower case, punctuation dropped, spaces to dashes."""
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*$", without_code(markdown.read_text()), re.M):
        found.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return found


def links(markdown: Path) -> list[str]:
    text = without_code(markdown.read_text())
    return INLINE.findall(text) + REFERENCE.findall(text) + AUTOLINK.findall(text)


def test_the_docs_exist():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "CHANGELOG.md", "docs/spec.md", "docs/peers.md"} <= names


@pytest.mark.parametrize("markdown", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_stay_inside_the_repository(markdown):
    text = without_code(markdown.read_text())
    assert not BARE_URL.findall(text), f"{markdown.name}: web addresses {BARE_URL.findall(text)}"
    for target in links(markdown):
        assert not re.match(r"[a-zA-Z][\w+.-]*:", target), f"{markdown.name}: {target} leaves"
        path, _, anchor = target.partition("#")
        assert not path.startswith("/"), f"{markdown.name}: absolute path {target}"
        resolved = (markdown.parent / path).resolve() if path else markdown
        assert resolved.is_relative_to(ROOT), f"{markdown.name}: {target} is outside the repo"
        assert resolved.exists(), f"{markdown.name}: {target} does not exist"
        if anchor:
            assert resolved.suffix == ".md", f"{markdown.name}: anchor into {target}"
            assert anchor in anchors(resolved), f"{markdown.name}: no heading for {target}"


def test_the_checker_catches_what_it_must(tmp_path):
    """The patterns above find each kind of escaping link (a checker that finds none passes)."""
    sample = tmp_path / "sample.md"
    sample.write_text(
        "See [spec](../shared/SPEC.md), [site](https://example.org/x) and\n"
        "<https://example.org/y>.\n\n[ref]: http://example.org/z\n\n"
        "`[not a link](../in/code)` and\n\n```\n[nor this](../in/block)\n```\n"
    )
    assert links(sample) == [
        "../shared/SPEC.md",
        "https://example.org/x",
        "http://example.org/z",
        "https://example.org/y",
    ]
