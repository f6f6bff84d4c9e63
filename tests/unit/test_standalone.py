"""The repository stands alone: nothing it tracks reaches outside its own root."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A reference that climbs out of the repository to a sibling folder, or names the
# folder this checkout happens to sit in.
# The planning folder that sits beside a checkout; spelt apart so this file names no path.
SIBLING = "shared"
OUTSIDE = re.compile(rf"\.\./{SIBLING}\b|(?<![\w.]){SIBLING}/(?:vectors|DESIGN|FLAGS|REFERENCE)\b")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def tracked_files() -> list[pathlib.Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    files = [ROOT / name for name in out.decode().split("\0") if name]
    return [path for path in files if path.is_file() and not path.is_symlink()]


def text_of(path: pathlib.Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def outside_references(text: str, root: str) -> list[str]:
    """What in `text` climbs out of the checkout at `root`: a sibling's path, or the
    checkout's own absolute path. Other paths under the same parent are fine: a clone
    under /tmp still names /tmp in its tests."""
    found = [m.group(0) for m in OUTSIDE.finditer(text)]
    parent = str(pathlib.PurePath(root).parent)
    # A checkout at the top of the file system has no folder of its own to name.
    if parent != "/":
        found += [name for name in (f"{root}/", f"{parent}/{SIBLING}") if name in text]
    return found


def test_no_tracked_file_reaches_outside_the_repository() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing lists the tracked files")
    problems = [
        f"{path.relative_to(ROOT)}: {refs}"
        for path in tracked_files()
        if path != pathlib.Path(__file__).resolve()
        and (text := text_of(path)) is not None
        and (refs := outside_references(text, str(ROOT)))
    ]
    assert not problems, "\n".join(problems)


def test_the_check_sees_an_outside_reference() -> None:
    root = "/srv/litegraph-node"
    assert outside_references(f"see [DESIGN](../{SIBLING}/DESIGN.md)", root)
    assert outside_references(f"VECTORS = ROOT / 'x'; {SIBLING}/vectors/paseto", root)
    assert outside_references("open('/srv/litegraph-node/tests/x')", root)
    assert outside_references(f"open('/srv/{SIBLING}/notes.md')", root)
    assert not outside_references("isolation: shared, on /dev/nvidia0 and /proc/1/stat", root)
    assert not outside_references("ReadWritePaths=/srv /tmp/state", root)
    assert not outside_references("http://127.0.0.1:7380/", "/litegraph-node")


def markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_inside_the_repository(path: pathlib.Path) -> None:
    for target in MARKDOWN_LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        resolved = (path.parent / target.split("#")[0]).resolve()
        assert resolved.is_relative_to(ROOT), f"{path.name} links outside: {target}"
        assert resolved.exists(), f"{path.name} links to a missing file: {target}"
