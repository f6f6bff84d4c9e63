"""A guest's `cwd`: opened once, checked as opened, bound from that descriptor.

The daemon decides what a cwd may be; bubblewrap mounts it. If both resolved the
name, a symlink on the way that a guest can write could point at a harmless
folder for the check and at the node's state for the mount. So the name is
opened once (O_PATH) and everything is decided on the opened folder: where it
really is (`/proc/self/fd/N`), what it is and what lies above it (device and
inode, walked up with `..`), whether the guest's uid could reach it; bubblewrap
then binds that very descriptor (`--ro-bind-fd`), which nothing can swap, and closes
it: the guest holds no handle outside its sandbox.

A cwd is refused when it is `/`, covers or lies inside a place of the sandbox's
own (a host folder there would replace it) or a place of the node's secrets, and,
where the operator gave an allow-list (`--guest-cwd-roots`, in `serve` none by
default), when where it really is lies under none of its roots: a symlink inside a
root that leads out of it leads to a refusal.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from supervisor.process_validation import InvalidProcessRequest

__all__ = ["SANDBOX_PLACES", "Protected", "open_cwd"]

# Private in every sandbox: bound over or inside one, a host folder would show the
# host's process table, devices, cgroups, sockets or temporary files instead.
SANDBOX_PLACES = ("/proc", "/sys", "/dev", "/run", "/tmp")  # noqa: S108 - names, not files
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
_MAX_DEPTH = 2048  # PATH_MAX / 2: no real folder is deeper

Identity = tuple[int, int]


@dataclass(frozen=True)
class Protected:
    """A place no cwd may cover or lie inside, and what to call it in a refusal."""

    path: Path
    what: str


def _refuse(message: str) -> InvalidProcessRequest:
    return InvalidProcessRequest("cwd", message)


def _identity(found: os.stat_result) -> Identity:
    return (found.st_dev, found.st_ino)


def _above(fd: int) -> Iterator[os.stat_result]:
    """The opened folder, then each folder above it up to `/`, as they are now."""
    here = os.fstat(fd)
    yield here
    current = os.dup(fd)
    try:
        for _ in range(_MAX_DEPTH):
            parent = os.open("..", _DIR_FLAGS, dir_fd=current)
            os.close(current)
            current = parent
            up = os.fstat(current)
            if _identity(up) == _identity(here):
                return  # `/`: its `..` is itself
            yield up
            here = up
        raise OSError(f"more than {_MAX_DEPTH} folders deep")
    finally:
        os.close(current)


def _identity_of(path: Path) -> Identity | None:
    try:
        return _identity(os.stat(path))
    except OSError:
        return None


def _check_places(real: Path, chain: Sequence[Identity], places: Sequence[Protected]) -> None:
    """By name (where the folder is bound in the sandbox) and by identity (a bind
    mount on the host may show the same folder under another name)."""
    for place in places:
        target = Path(os.path.realpath(place.path))
        own = _identity_of(target)
        above = {_identity_of(folder) for folder in target.parents} - {None}
        if real == target or own == chain[0]:
            raise _refuse(f"{real} is {place.what} ({target})")
        if target.is_relative_to(real) or chain[0] in above:
            raise _refuse(f"{real} covers {place.what} ({target})")
        if real.is_relative_to(target) or own in chain:
            raise _refuse(f"{real} lies inside {place.what} ({target})")


def _searchable(found: os.stat_result, uid: int) -> bool:
    # setpriv gives the guest the gid of its uid's number and no other group.
    if found.st_uid == uid:
        return bool(found.st_mode & stat.S_IXUSR)
    if found.st_gid == uid:
        return bool(found.st_mode & stat.S_IXGRP)
    return bool(found.st_mode & stat.S_IXOTH)


def _outside_roots(real: Path, roots: Sequence[Path]) -> str:
    """Why a cwd outside every root is refused, and what the caller may do instead."""
    instead = "send no cwd and the guest starts in its private /tmp"
    if not roots:
        return (
            f"{real}: this node allows no cwd (it has no --guest-cwd-roots or "
            f"--guest-writable-roots); {instead}"
        )
    listed = ", ".join(map(str, roots))
    return (
        f"{real} lies under none of this node's cwd roots ({listed}; --guest-cwd-roots "
        f"and --guest-writable-roots): name a folder under one, or {instead}"
    )


def open_cwd(
    cwd: str,
    places: Sequence[Protected],
    uid: int | None,
    roots: Sequence[Path] | None = None,
) -> tuple[int, Path]:
    """An O_PATH descriptor of the folder `cwd` names and where it really is, once
    checked (the caller closes it); else `InvalidProcessRequest` saying why.

    The daemon may open what `uid` could not reach (as root it passes every
    permission): with a `uid`, every folder above must let that uid through, as
    when bubblewrap, run as the guest, resolved the name itself. With `roots` (real
    paths), the folder must really be one of them or lie under one, whole folder
    names compared (`/srv/ab` is not under `/srv/a`); None: no allow-list."""
    try:
        fd = os.open(cwd, _DIR_FLAGS)
    except OSError as exc:
        raise _refuse(f"{cwd} cannot be opened: {exc.strerror}") from None
    try:
        real = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if not real.is_absolute():  # outside the daemon's root
            raise _refuse(f"{cwd} is not reachable from the node's root")
        try:
            stats = list(_above(fd))
        except OSError as exc:  # removed since it was opened, or absurdly deep
            raise _refuse(f"{real} cannot be walked up: {exc}") from None
        if len(stats) == 1:
            raise _refuse("/ would cover the whole sandbox")
        _check_places(real, [_identity(s) for s in stats], places)
        if roots is not None and not any(real.is_relative_to(root) for root in roots):
            raise _refuse(_outside_roots(real, roots))
        if uid is not None and not all(_searchable(s, uid) for s in stats[1:]):
            raise _refuse(f"{real}: a folder above it does not let the guest's uid through")
    except BaseException:
        os.close(fd)
        raise
    return fd, real
