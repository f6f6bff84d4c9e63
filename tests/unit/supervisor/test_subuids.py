"""Subordinate uids (supervisor/subuids.py): which ranges /etc/subuid and /etc/subgid
give a user, which of them guests may have, and that making the guests' user namespace
never leaves its holder behind. The whole way, as a normal user against the real
kernel: tests/confinement/test_guest_subuids.py."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import time

import pytest

from supervisor import subuids
from supervisor.subuids import (
    SubidsUnavailable,
    SubidTools,
    find_subid_tools,
    guest_subids,
    open_guest_userns,
    parse_subids,
)

FILE = """\
# subordinate ids
alice:100000:65536
1001:300000:10
bob:165536:65536
alice:400000:1000

alice:500000
alice:x:10
alice:600000:-5
alice:700000:0
alice:800000:10:extra
 alice : 900000 : 10
alicex:1000000:10
"""


def test_a_users_ranges_are_found_by_name_and_by_uid_in_file_order() -> None:
    found = parse_subids(FILE, user="alice", uid=1001)
    assert found == [range(100000, 165536), range(300000, 300010), range(400000, 401000)]
    assert parse_subids(FILE, user="bob", uid=1002) == [range(165536, 231072)]
    # An account-less uid still has the ranges given by number.
    assert parse_subids(FILE, user=None, uid=1001) == [range(300000, 300010)]


@pytest.mark.parametrize(
    "line",
    [
        "# alice:100000:10",
        "",
        "alice:500000",
        "alice:x:10",
        "alice:600000:-5",
        "alice:700000:0",
        "alice:800000:10:extra",
        " alice : 900000 : 10",
        "alicex:1000000:10",
        "carol:100000:10",
        "alice:1e5:10",
    ],
)
def test_malformed_lines_and_other_users_lines_are_ignored(line: str) -> None:
    """A comment, a blank, two or four fields, a bad or negative number, a count of 0,
    spaces in a field, a name that merely starts with the user's, another user."""
    assert parse_subids(f"{line}\nalice:5000:10\n", user="alice", uid=1001) == [range(5000, 5010)]


def _files(tmp_path: pathlib.Path, uids: str, gids: str) -> dict[str, pathlib.Path]:
    (tmp_path / "subuid").write_text(uids)
    (tmp_path / "subgid").write_text(gids)
    return {"subuid_file": tmp_path / "subuid", "subgid_file": tmp_path / "subgid"}


def test_guests_get_the_largest_run_of_ids_that_are_the_users_uids_and_gids_both(
    tmp_path: pathlib.Path,
) -> None:
    files = _files(
        tmp_path,
        "alice:100000:1000\nalice:200000:65536\n",
        "alice:100000:1000\nalice:230000:100000\n",
    )
    # 200000-265535 as uids and 230000-329999 as gids overlap in 230000-265535.
    assert guest_subids("alice", 1001, 1001, **files) == range(230000, 265536)


def test_guest_ids_are_never_system_ids_nor_the_daemons_own(tmp_path: pathlib.Path) -> None:
    files = _files(tmp_path, "alice:0:2000\n", "alice:0:2000\n")
    # Below 1000 are system accounts; the daemon's uid 1900 and gid 1200 split the rest
    # into 1000-1199, 1201-1899 and 1901-1999.
    assert guest_subids("alice", 1900, 1200, **files) == range(1201, 1900)
    files = _files(tmp_path, "alice:900:200\n", "alice:900:200\n")
    assert guest_subids("alice", 50, 50, **files) == range(1000, 1100)


@pytest.mark.parametrize(
    ("uids", "gids", "why"),
    [
        (None, "alice:100000:10\n", "no subordinate uids for alice (uid 1001) in"),
        ("bob:100000:10\n", "alice:100000:10\n", "no subordinate uids for alice"),
        ("alice:100000:10\n", "", "no subordinate gids for alice (uid 1001) in"),
        ("alice:100000:10\n", "alice:200000:10\n", "share no ids"),
        ("alice:10:10\n", "alice:10:10\n", "share no ids at or above 1000"),
    ],
)
def test_without_usable_ids_the_reason_says_which_file_lacks_what(
    tmp_path: pathlib.Path, uids: str | None, gids: str, why: str
) -> None:
    files = _files(tmp_path, uids or "", gids)
    if uids is None:
        files["subuid_file"].unlink()  # no file at all: none given
    with pytest.raises(SubidsUnavailable, match=re.escape(why)):
        guest_subids("alice", 1001, 1001, **files)


def test_an_unreadable_file_is_said_not_taken_for_none(tmp_path: pathlib.Path) -> None:
    files = _files(tmp_path, "", "")
    files["subuid_file"].unlink()
    files["subuid_file"].mkdir()  # reading a folder fails: not "no ranges"
    with pytest.raises(SubidsUnavailable, match="unreadable"):
        guest_subids("alice", 1001, 1001, **files)


def test_missing_helpers_are_named_with_the_package_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(subuids, "_which", lambda name: None if "map" in name else f"/x/{name}")
    with pytest.raises(SubidsUnavailable) as raised:
        find_subid_tools()
    assert "newuidmap and newgidmap not found" in str(raised.value)
    assert "apt-get install uidmap" in str(raised.value)
    monkeypatch.setattr(subuids, "_which", lambda name: f"/x/{name}")
    assert find_subid_tools() == SubidTools("/x/unshare", "/x/newuidmap", "/x/newgidmap")


def _holders() -> list[int]:
    """Our children that are (or were) a holder, zombies included."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == os.getpid() and (b"echo ready" in cmdline):
            found.append(int(entry))
    return found


UNSHARE = shutil.which("unshare", path="/usr/bin:/bin")


@pytest.mark.skipif(UNSHARE is None, reason="needs unshare (util-linux)")
def test_a_failed_map_leaves_no_holder_and_no_descriptor() -> None:
    assert UNSHARE is not None
    before = set(os.listdir("/proc/self/fd"))
    tools = SubidTools(unshare=UNSHARE, newuidmap="/bin/false", newgidmap="/bin/false")
    with pytest.raises(SubidsUnavailable, match=r"false failed \(exit 1\)"):
        open_guest_userns(range(410000, 410010), tools)
    assert _holders() == []
    assert set(os.listdir("/proc/self/fd")) <= before


def test_a_holder_that_never_starts_is_killed_within_its_bound(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stuck = tmp_path / "unshare"
    stuck.write_text("#!/bin/sh\nwhile :; do sleep 1; done\n")
    stuck.chmod(0o755)
    monkeypatch.setattr(subuids, "STEP_SECONDS", 0.2)
    tools = SubidTools(unshare=str(stuck), newuidmap="/bin/true", newgidmap="/bin/true")
    started = time.monotonic()
    with pytest.raises(SubidsUnavailable, match="did not start"):
        open_guest_userns(range(410000, 410010), tools)
    assert time.monotonic() - started < 5
    assert _holders() == []


def test_a_holder_that_makes_no_namespace_is_said_and_reaped() -> None:
    tools = SubidTools(unshare="/bin/false", newuidmap="/bin/true", newgidmap="/bin/true")
    with pytest.raises(SubidsUnavailable, match="unshare --user failed"):
        open_guest_userns(range(410000, 410010), tools)
    assert _holders() == []
