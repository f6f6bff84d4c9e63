"""A guest's cwd is opened once and checked as opened: what it is, covers or lies
inside, whether the guest's uid could reach it and whether it really lies under one
of the operator's roots (supervisor/guest_cwd.py)."""

from __future__ import annotations

import os
import pathlib

import pytest

from supervisor.guest_cwd import Protected, open_cwd
from supervisor.guests import GuestPolicy
from supervisor.process import InvalidProcessRequest
from tests.helpers import guest_cwd
from tests.unit.supervisor.test_guests import session_with


def _refusal(cwd: str | pathlib.Path, places: list[Protected], uid: int | None = None) -> str:
    with pytest.raises(InvalidProcessRequest) as refused:
        fd, _ = open_cwd(str(cwd), places, uid)
        os.close(fd)
    assert refused.value.field == "cwd"
    return refused.value.message


def test_a_cwd_is_refused_when_it_is_covers_or_lies_inside_a_protected_place(
    tmp_path: pathlib.Path,
) -> None:
    state = tmp_path / "node" / "state"
    (state / "keys").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    places = [Protected(state, "the node's state folder"), Protected(pathlib.Path("/proc"), "P")]
    assert _refusal("/", places) == "/ would cover the whole sandbox"
    assert _refusal(state, places).endswith(f"is the node's state folder ({state})")
    assert "lies inside the node's state folder" in _refusal(state / "keys", places)
    assert "covers the node's state folder" in _refusal(tmp_path / "node", places)
    assert "covers the node's state folder" in _refusal(tmp_path, places)
    assert "lies inside P (/proc)" in _refusal("/proc/self", places)  # /proc/<pid>, really
    assert "cannot be opened" in _refusal(tmp_path / "missing", places)
    fd, real = open_cwd(str(tmp_path / "elsewhere"), places, None)
    os.close(fd)
    assert real == tmp_path / "elsewhere"


def test_the_folder_checked_is_the_folder_opened_whatever_the_name_points_at_later(
    tmp_path: pathlib.Path,
) -> None:
    state, harmless = tmp_path / "state", tmp_path / "harmless"
    state.mkdir()
    harmless.mkdir()
    link = tmp_path / "link"
    link.symlink_to(state)
    places = [Protected(state, "the node's state folder")]
    assert f"{state} is the node's state folder" in _refusal(link, places)
    link.unlink()
    link.symlink_to(harmless)
    fd, real = open_cwd(str(link), places, None)
    try:
        link.unlink()
        link.symlink_to(state)  # flipped after the check: the descriptor stays put
        assert real == harmless
        assert os.readlink(f"/proc/self/fd/{fd}") == str(harmless)
        assert os.path.samestat(os.fstat(fd), harmless.stat())
    finally:
        os.close(fd)


def test_a_folder_the_guests_uid_could_not_reach_is_refused() -> None:
    closed = guest_cwd() / "closed"  # every folder above lets others through
    (closed / "work").mkdir(parents=True)
    uid = 300_123  # owns nothing here: passes only where others may
    closed.chmod(0o700)
    assert "does not let the guest's uid through" in _refusal(closed / "work", [], uid)
    fd, _ = open_cwd(str(closed / "work"), [], None)  # the daemon's own user reaches it
    os.close(fd)
    closed.chmod(0o711)
    fd, _ = open_cwd(str(closed / "work"), [], uid)
    os.close(fd)


def test_the_policy_protects_the_sandboxs_places_the_state_the_run_dir_and_the_auth_file(
    tmp_path: pathlib.Path,
) -> None:
    auth = tmp_path / "conf" / "auth.json"
    auth.parent.mkdir()
    auth.write_text("{}")
    policy = GuestPolicy(
        bwrap=None,
        uids=None,
        state_dir=tmp_path / "state",
        hidden=(auth,),
        run_dir=tmp_path / "run",
    )
    named = {str(place.path): place.what for place in policy.protected()}
    for folder in ("/proc", "/sys", "/dev", "/run", "/tmp"):
        assert named[folder] == f"the sandbox's private {folder}"
    assert named[str(tmp_path / "state")] == "the node's state folder"
    assert named[str(tmp_path / "run")].startswith("the guests' run folder")
    assert named[str(auth)] == "the node's auth file"
    auth_only = [place for place in policy.protected() if place.path == auth]
    assert "covers the node's auth file" in _refusal(auth.parent, auth_only)
    with pytest.raises(InvalidProcessRequest, match="lies inside the sandbox's private /tmp"):
        policy.check_cwd(str(tmp_path))  # pytest's tmp_path lies in /tmp


def test_a_cwd_is_judged_on_where_it_really_is_against_the_roots(tmp_path: pathlib.Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a" / "b").mkdir(parents=True)
    outside.mkdir()
    (tmp_path / "rootx").mkdir()  # starts as the root's name does: not under it
    (root / "escape").symlink_to(outside)
    (outside / "in").symlink_to(root / "a")
    roots = [root]
    for cwd, real in (
        (root, root),
        (root / "a" / "b", root / "a" / "b"),
        (outside / "in", root / "a"),
    ):
        fd, found = open_cwd(str(cwd), [], None, roots)
        os.close(fd)
        assert found == real
    for cwd, real in (
        (root / "escape", outside),
        (outside, outside),
        (tmp_path / "rootx", tmp_path / "rootx"),
    ):
        message = _refusal_under(cwd, roots)
        assert message.startswith(f"{real} lies under none of this node's cwd roots ({root}; ")
        assert message.endswith("or send no cwd and the guest starts in its private /tmp")
    assert _refusal_under(root, []) == (
        f"{root}: this node allows no cwd (it has no --guest-cwd-roots or "
        "--guest-writable-roots); send no cwd and the guest starts in its private /tmp"
    )
    fd, _ = open_cwd(str(outside), [], None, None)  # None: no allow-list at all
    os.close(fd)


def _refusal_under(cwd: pathlib.Path, roots: list[pathlib.Path]) -> str:
    with pytest.raises(InvalidProcessRequest) as refused:
        fd, _ = open_cwd(str(cwd), [], None, roots)
        os.close(fd)
    return refused.value.message


def test_writable_roots_are_cwd_roots_too_and_the_guests_start_checks_again() -> None:
    cwd_root, writable, outside = guest_cwd(), guest_cwd(), guest_cwd()
    state = guest_cwd() / "state"
    policy = GuestPolicy(
        bwrap=None, uids=None, state_dir=state, cwd_roots=(cwd_root,), writable_roots=(writable,)
    )
    assert policy.allowed_roots() == (cwd_root, writable)
    assert GuestPolicy(bwrap=None, uids=None, state_dir=state).allowed_roots() is None
    policy.check_cwd(str(cwd_root))
    policy.check_cwd(str(writable))
    with pytest.raises(InvalidProcessRequest, match="lies under none of this node's cwd roots"):
        policy.check_cwd(str(outside))
    # Admitted by name, then swapped for a folder outside: the start opens it again.
    link = outside / "link"
    link.symlink_to(writable)
    policy.check_cwd(str(link))
    link.unlink()
    link.symlink_to(outside)
    with (
        pytest.raises(InvalidProcessRequest, match="lies under none of this node's cwd roots"),
        session_with(policy, str(link)),
    ):
        pass
