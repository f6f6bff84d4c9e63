"""Subordinate uids: a uid of its own for every guest of a daemon that is not root.

A normal user may own ranges of uids and gids (`/etc/subuid`, `/etc/subgid`,
lines `name_or_uid:start:count`), which the setuid helpers `newuidmap` and
`newgidmap` (Debian's `uidmap`) let it map into a user namespace it made. At
start-up the daemon makes one such namespace (`open_guest_userns`): a short-lived
holder (`unshare --user`) creates it, the helpers map the range into it id for id
(inside uid N is host uid N), the daemon keeps a descriptor of it and the holder
ends at once. The namespace lives as long as that descriptor or a process in it.

A guest then enters it (`nsenter --user=/proc/self/fd/N --setuid U --setgid U`,
which also drops every supplementary group: `supervisor/launch.py`) and execs
bubblewrap as uid U, with no capability; bubblewrap nests its own user namespace
mapping U to itself, as it does for any normal user. So the guest runs as host
uid U: a uid no other running guest has (the pool of `supervisor.identity` hands
them out, round-robin with its cursor), not the daemon's. The daemon owns the
namespace, so it may still signal its guests; a guest holds no capability in it,
nor over another guest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import select
import shutil
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from supervisor.identity import MAX_GUEST_UID, MIN_GUEST_UID

__all__ = [
    "SUBGID_FILE",
    "SUBUID_FILE",
    "GuestUserns",
    "SubidTools",
    "SubidsUnavailable",
    "find_subid_tools",
    "guest_subids",
    "open_guest_userns",
    "parse_subids",
]

SUBUID_FILE = Path("/etc/subuid")
SUBGID_FILE = Path("/etc/subgid")
# The setuid helpers and unshare: only from the system's own folders.
_SYSTEM_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
_MAX_FILE_BYTES = 1 << 20
STEP_SECONDS = 5.0


class SubidsUnavailable(RuntimeError):
    """Guests cannot get subordinate uids here; the message says why (for the note)."""


def parse_subids(text: str, *, user: str | None, uid: int) -> list[range]:
    """The ranges an `/etc/subuid` (or `/etc/subgid`) text gives the user named `user`
    or numbered `uid`, in file order. Lines are `owner:start:count`; any other line
    (a comment, a blank, a bad number, a count of 0) is ignored, as newuidmap does."""
    found: list[range] = []
    for line in text.splitlines():
        fields = line.strip().split(":")
        if len(fields) != 3:
            continue
        owner, start, count = fields
        if owner not in (user, str(uid)) or not start.isdigit() or not count.isdigit():
            continue
        if int(count) > 0:
            found.append(range(int(start), int(start) + int(count)))
    return found


def _read(path: Path, *, user: str | None, uid: int) -> list[range]:
    try:
        with open(path, "rb") as source:
            text = source.read(_MAX_FILE_BYTES).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise SubidsUnavailable(f"{path} unreadable: {exc.strerror}") from exc
    return parse_subids(text, user=user, uid=uid)


def _overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def _usable(ids: range, own: Iterable[int]) -> list[range]:
    """`ids` within the guest uid bounds, split around the daemon's own uid and gid."""
    pieces = [_overlap(ids, range(MIN_GUEST_UID, MAX_GUEST_UID + 1))]
    for taken in own:
        pieces = [
            part
            for piece in pieces
            for part in (
                range(piece.start, min(piece.stop, taken)),
                range(max(piece.start, taken + 1), piece.stop),
            )
        ]
    return [piece for piece in pieces if piece]


def guest_subids(
    user: str | None,
    uid: int,
    gid: int,
    *,
    subuid_file: Path = SUBUID_FILE,
    subgid_file: Path = SUBGID_FILE,
) -> range:
    """The largest run of ids that are the user's subordinate uids and gids both (a
    guest's gid is the number of its uid), at or above the system accounts and never
    the daemon's own uid or gid; the first of equal ones. Raises SubidsUnavailable."""
    who = f"{user} (uid {uid})" if user else f"uid {uid}"
    uids = _read(subuid_file, user=user, uid=uid)
    if not uids:
        raise SubidsUnavailable(f"no subordinate uids for {who} in {subuid_file}")
    gids = _read(subgid_file, user=user, uid=uid)
    if not gids:
        raise SubidsUnavailable(f"no subordinate gids for {who} in {subgid_file}")
    best = range(0)
    for ids in uids:
        for gid_range in gids:
            for piece in _usable(_overlap(ids, gid_range), (uid, gid)):
                if len(piece) > len(best):
                    best = piece
    if not best:
        raise SubidsUnavailable(
            f"the subordinate uids of {who} in {subuid_file} share no ids at or above "
            f"{MIN_GUEST_UID} with its subordinate gids in {subgid_file}"
        )
    return best


@dataclasses.dataclass(frozen=True)
class SubidTools:
    unshare: str
    newuidmap: str
    newgidmap: str


@functools.cache
def _which(name: str) -> str | None:
    return shutil.which(name, path=_SYSTEM_PATH)


def find_subid_tools() -> SubidTools:
    """newuidmap and newgidmap (uidmap) and unshare (util-linux), from the system's
    folders only. Raises SubidsUnavailable naming what is missing."""
    found = {name: _which(name) for name in ("unshare", "newuidmap", "newgidmap")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        packages = {"newuidmap": "uidmap", "newgidmap": "uidmap"}
        needed = sorted({packages.get(name, "util-linux") for name in missing})
        raise SubidsUnavailable(
            f"{' and '.join(missing)} not found (install {' and '.join(needed)}, e.g. "
            f"apt-get install {' '.join(needed)})"
        )
    return SubidTools(**{name: str(path) for name, path in found.items()})


@dataclasses.dataclass
class GuestUserns:
    """The user namespace every guest of this daemon enters: `ids` mapped id for id.

    `fd` is a descriptor of it (close-on-exec; a launch passes a copy), held while
    the daemon runs; `close()` lets it go (guests still in it keep it alive)."""

    fd: int
    ids: range

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _read_line(stream: int, deadline: float) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([stream], [], [], left)[0]:
            raise SubidsUnavailable(f"unshare --user did not start within {STEP_SECONDS:g}s")
        chunk = os.read(stream, 64)
        if not chunk:
            break
        data += chunk
    return data


def _map(tool: str, pid: int, ids: range) -> None:
    argv = [tool, str(pid), str(ids.start), str(ids.start), str(len(ids))]
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=STEP_SECONDS,
            check=False,
            env={"PATH": _SYSTEM_PATH},
            cwd="/",
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise SubidsUnavailable(f"{Path(tool).name} did not run: {exc}") from exc
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip()[:300]
        raise SubidsUnavailable(f"{Path(tool).name} failed (exit {done.returncode}): {why}")


def _mapped(pid: int, name: str) -> list[str]:
    with open(f"/proc/{pid}/{name}", encoding="ascii") as found:
        return found.read().split()


def open_guest_userns(ids: range, tools: SubidTools) -> GuestUserns:
    """Make the guests' user namespace (blocking; each step bounded by STEP_SECONDS).

    The holder is our child and unreaped throughout, so its pid names it alone; it
    is ended and reaped however this ends. Raises SubidsUnavailable."""
    holder = subprocess.Popen(
        [tools.unshare, "--user", "--", "/bin/sh", "-c", "echo ready && read -r _"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"PATH": _SYSTEM_PATH},
        cwd="/",
    )
    assert holder.stdin is not None and holder.stdout is not None and holder.stderr is not None
    try:
        if _read_line(holder.stdout.fileno(), time.monotonic() + STEP_SECONDS) != b"ready\n":
            holder.kill()
            why = holder.stderr.read(300).decode(errors="replace").strip()
            raise SubidsUnavailable(f"unshare --user failed: {why or 'no namespace made'}")
        _map(tools.newuidmap, holder.pid, ids)
        _map(tools.newgidmap, holder.pid, ids)
        expected = [str(ids.start), str(ids.start), str(len(ids))]
        if _mapped(holder.pid, "uid_map") != expected or _mapped(holder.pid, "gid_map") != expected:
            raise SubidsUnavailable("the user namespace's maps are not those written")
        fd = os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        if os.fstat(fd).st_ino == os.stat("/proc/self/ns/user").st_ino:
            os.close(fd)
            raise SubidsUnavailable("unshare --user made no user namespace")
        return GuestUserns(fd=fd, ids=ids)
    finally:
        with contextlib.suppress(OSError):
            holder.stdin.close()
        try:
            holder.wait(timeout=STEP_SECONDS)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
        holder.stdout.close()
        holder.stderr.close()
