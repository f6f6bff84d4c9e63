"""Where `dev`'s guests get their uids when it cannot switch users (node/guests.py):
the reasons it gives for sharing its own, and a run dir its guests can reach. The
whole way, as a normal user: tests/confinement/test_guest_subuids.py."""

from __future__ import annotations

import os
import pathlib
import pwd

import msgspec
import pytest

import node.guests
from node.guests import SHARED_UID_NOTE, _shared_uid_note, _subordinate_uids, default_run_dir
from tests.api_fixtures import daemon_config


def test_dev_guests_with_subordinate_uids_get_a_run_dir_they_can_reach(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """$XDG_RUNTIME_DIR is 0700: its user's alone, no subordinate uid enters it."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/4242")
    assert default_run_dir(dev=True) == pathlib.Path("/run/user/4242/litegraph-node")
    own = default_run_dir(dev=True, own_uids=True)
    assert own == pathlib.Path(f"/tmp/litegraph-node-{os.geteuid()}")
    assert default_run_dir(dev=False, own_uids=True) == pathlib.Path("/run/litegraph-node")


def _subids(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, line: str) -> None:
    for name in ("subuid", "subgid"):
        (tmp_path / name).write_text(line)
    monkeypatch.setattr(node.guests, "SUBUID_FILE", tmp_path / "subuid")
    monkeypatch.setattr(node.guests, "SUBGID_FILE", tmp_path / "subgid")


async def test_the_reasons_dev_gives_for_sharing_its_uid(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    me = pwd.getpwuid(os.geteuid()).pw_name
    config = daemon_config(tmp_path)
    off = msgspec.structs.replace(config, guest_subuids=False)
    assert await _subordinate_uids(off, tmp_path) == "--no-guest-subuids was given"
    _subids(tmp_path, monkeypatch, "")
    assert await _subordinate_uids(config, tmp_path) == (
        f"no subordinate uids for {me} (uid {os.geteuid()}) in {tmp_path / 'subuid'}"
    )
    _subids(tmp_path, monkeypatch, f"{me}:410000:3\n")
    few = msgspec.structs.replace(config, max_running=4)
    assert await _subordinate_uids(few, tmp_path) == (
        "the subordinate uids 410000-410002 are fewer than --max-running 4"
    )
    note = _shared_uid_note("why")
    assert note.startswith(f"{SHARED_UID_NOTE}: why, so guests run as the daemon's own user")
    assert "cannot switch users" in note and "/etc/subuid" in note
