"""The concepts page's picture: a committed SVG made from its Graphviz source, that fetches
nothing when a browser shows it (CI and many clusters have no internet)."""

from __future__ import annotations

import re
from pathlib import Path

STATIC = Path(__file__).resolve().parents[2] / "docs" / "_static"


def test_the_svg_is_committed_beside_its_source() -> None:
    dot = (STATIC / "concepts.dot").read_text(encoding="utf-8")
    assert "dot -Tsvg docs/_static/concepts.dot -o docs/_static/concepts.svg" in dot
    svg = (STATIC / "concepts.svg").read_text(encoding="utf-8")
    assert "<svg" in svg and "<title>concepts</title>" in svg


def test_the_svg_fetches_nothing() -> None:
    svg = (STATIC / "concepts.svg").read_text(encoding="utf-8")
    assert not re.search(r"url\(|@import|@font-face", svg)
    # links: only the XML namespaces and the DTD's public identifier, which no browser loads
    hrefs = re.findall(r"(?:href|src)=\"([^\"]*)\"", svg)
    assert not [h for h in hrefs if "//" in h], hrefs
    fonts = set(re.findall(r'font-family="([^"]*)"', svg))
    assert fonts <= {"sans-serif", "serif", "monospace"}, fonts
