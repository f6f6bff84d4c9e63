"""Files a claim's pods read, each written whole (aside, then renamed over, so nothing
ever reads half of one), and the claim's own folder."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

__all__ = ["TOKEN_NAME", "claim_folder", "remove_folder", "write_tokens", "write_whole"]

TOKEN_NAME = "token"  # noqa: S105 - a file name


def write_whole(path: Path, data: bytes, mode: int) -> None:
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    aside.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(aside, flags, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        aside.replace(path)
    except BaseException:
        aside.unlink(missing_ok=True)
        raise


def claim_folder(claims_dir: Path, claim_uid: str) -> Path:
    """The claim's folder, made if it is not there: 0755 in the claims' own 0700 folder,
    so that only its pods (where it is mounted) reach it, whatever uid they run as."""
    claims_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    claims_dir.chmod(0o700)  # whatever the umask made (no pod reaches these two paths)
    folder = claims_dir / claim_uid
    folder.mkdir(mode=0o755, exist_ok=True)
    folder.chmod(0o755)
    return folder


def write_tokens(folder: Path, tokens: Sequence[str]) -> None:
    """The claim's token file (0444, in a folder only its pods reach): one token per
    line, in its lanes' order (the order of LITEGRAPH_LANE_IDS), as a sandbox guest's."""
    write_whole(folder / TOKEN_NAME, "".join(f"{token}\n" for token in tokens).encode(), 0o444)


def remove_folder(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
