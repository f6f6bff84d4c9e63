"""A small filesystem of its own (a tmpfs) for tests of what a full disk does."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["free_bytes", "small_tmpfs"]


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (`8m`) mounted at `path` (made, mode 0700), unmounted after.
    Skips where it cannot be mounted (not root, no mount namespace rights)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


def free_bytes(path: Path) -> int:
    """Free space of `path`'s filesystem, as the disk floor reads it."""
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize
