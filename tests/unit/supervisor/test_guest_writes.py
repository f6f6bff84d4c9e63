"""What a guest may write is bounded by its grant: a private /tmp sized to its memory,
a read-only cwd unless the operator allowed host writes under its root (issue 22,
finding 4). The kernel's side is in tests/confinement/test_guest_writes.py."""

from __future__ import annotations

import pathlib
from typing import Any

from supervisor.guests import GuestPolicy
from supervisor.sandbox import GUEST_TMP, SandboxSpec, bwrap_argv
from tests.helpers import guest_cwd
from tests.unit.supervisor.test_guests import session_with

BWRAP = pathlib.Path("/usr/bin/bwrap")
MiB = 2**20


def _argv(**fields: Any) -> list[str]:
    return bwrap_argv(SandboxSpec(bwrap=BWRAP, isolate_network=False, **fields), ["x"])


def test_the_private_tmp_is_a_tmpfs_of_the_memory_grant() -> None:
    argv = _argv(tmp_bytes=64 * MiB)
    at = argv.index(GUEST_TMP, argv.index("--tmpfs"))
    # bwrap's --size applies to the --tmpfs right after it.
    assert argv[at - 3 : at + 1] == ["--size", str(64 * MiB), "--tmpfs", GUEST_TMP]
    assert "--size" not in _argv()  # no grant given: the kernel's default size


def _bind_of(argv: list[str], option: str) -> list[str]:
    at = argv.index(option)
    return argv[at : at + 3]


def test_a_cwd_is_bound_read_only_unless_writable() -> None:
    fields: dict[str, Any] = {"cwd": "/srv/work", "cwd_fd": 5}
    ro = _argv(**fields)
    assert _bind_of(ro, "--ro-bind-fd") == ["--ro-bind-fd", "5", "/srv/work"]
    rw = _argv(cwd_writable=True, **fields)
    assert _bind_of(rw, "--bind-fd") == ["--bind-fd", "5", "/srv/work"]


def _session(policy: GuestPolicy, cwd: pathlib.Path | None) -> Any:
    return session_with(policy, None if cwd is None else str(cwd), 64 * MiB)


def test_a_guests_cwd_is_writable_only_under_a_writable_root(tmp_path: pathlib.Path) -> None:
    root = guest_cwd()
    inside, outside = root / "project" / "sub", guest_cwd()
    inside.mkdir(parents=True)
    policy = GuestPolicy(
        bwrap=BWRAP,
        uids=None,
        state_dir=tmp_path / "state",
        run_dir=tmp_path,
        writable_roots=(root,),
    )
    with _session(policy, inside) as guest:
        assert (guest.sandbox.cwd, guest.sandbox.cwd_writable) == (str(inside), True)
        assert guest.env["HOME"] == str(inside)
        assert guest.sandbox.tmp_bytes == 64 * MiB
    for cwd in (outside, root.parent):  # a sibling, and the folder above the root
        with _session(policy, cwd) as guest:
            assert (guest.sandbox.cwd, guest.sandbox.cwd_writable) == (str(cwd), False)
            assert guest.env["HOME"] == GUEST_TMP  # a read-only home would break tools
    with _session(policy, None) as guest:
        assert (guest.sandbox.cwd, guest.sandbox.cwd_writable) == (None, False)
        assert guest.sandbox.tmp_bytes == 64 * MiB


def test_a_root_matches_whole_folder_names_only(tmp_path: pathlib.Path) -> None:
    policy = GuestPolicy(
        bwrap=BWRAP, uids=None, state_dir=tmp_path, writable_roots=(pathlib.Path("/srv/a"),)
    )
    assert policy.host_writable(pathlib.Path("/srv/a"))
    assert policy.host_writable(pathlib.Path("/srv/a/b"))
    assert not policy.host_writable(pathlib.Path("/srv/ab"))
    assert not policy.host_writable(pathlib.Path("/srv"))
    assert not GuestPolicy(bwrap=BWRAP, uids=None, state_dir=tmp_path).host_writable(
        pathlib.Path("/srv/a")
    )
