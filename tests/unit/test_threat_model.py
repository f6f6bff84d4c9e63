"""The threat model cites tests as evidence: every cited file and test must exist."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT / "threat-model" / "README.md"
# `unit/test_x.py::test_y` or `unit/test_x.py` (relative to tests/); `::test_z` continues
# the file named just before it.
FOLDERS = "unit|integration|property|adversarial|soak|confinement"
CITATION = re.compile(rf"`((?:{FOLDERS})/[\w/]+\.py)((?:::\w+)?)`")
CONTINUATION = re.compile(r"`::(\w+)`")


def _citations() -> list[tuple[str, str | None]]:
    found: list[tuple[str, str | None]] = []
    for line in MODEL.read_text().splitlines():
        last = None
        for match in re.finditer(f"{CITATION.pattern}|{CONTINUATION.pattern}", line):
            if match.group(1):
                last = match.group(1)
                found.append((last, match.group(2)[2:] or None))
            elif last is not None:
                found.append((last, match.group(3)))
    return found


def test_every_cited_test_exists() -> None:
    citations = _citations()
    assert len(citations) > 40
    for path, name in citations:
        source = ROOT / "tests" / path
        assert source.exists(), f"threat model cites a missing file: {path}"
        if name:
            assert re.search(rf"def {name}\b", source.read_text()), f"missing: {path}::{name}"


def test_every_boundary_has_a_stride_table() -> None:
    text = MODEL.read_text()
    for boundary in ("B1", "B2", "B3", "B4", "B5", "B6", "B7", "B8"):
        assert f"### {boundary} " in text
