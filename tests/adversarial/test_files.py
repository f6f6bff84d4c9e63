"""Secret and state files that others could read or redirect are refused, not used.

Unit level: KeyRing.open, api.auth.load_auth / load_or_create_auth, Journal.open.
Process level: `litegraph-node serve` exits with status 1 and one line naming the
file, and writes nothing through the bad path.
"""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from api.auth import AuthError, load_auth, load_or_create_auth
from capabilities import KeyFileError, KeyFileProblem, KeyRing
from machine.journal import JOURNAL_FILENAME, Journal, JournalUnsafe, UnsafeReason
from tests.helpers import clean_env, node_command

pytestmark = pytest.mark.hostile("files")

LOOSE = [0o644, 0o640, 0o604, 0o660, 0o666, 0o700, 0o610]
LOOSE_IDS = [f"{mode:04o}" for mode in LOOSE]


def _keyring(tmp_path: pathlib.Path) -> pathlib.Path:
    state = tmp_path / "state"
    KeyRing.open(state)
    [key] = sorted((state / "keys").iterdir())
    return key


# --- key files ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", LOOSE, ids=LOOSE_IDS)
def test_files_key_file_loose_mode_refused(tmp_path: pathlib.Path, mode: int) -> None:
    key = _keyring(tmp_path)
    os.chmod(key, mode)
    if mode & 0o077 == 0:  # 0700: executable but private -- not loose
        KeyRing.open(tmp_path / "state")
        return
    with pytest.raises(KeyFileError) as refused:
        KeyRing.open(tmp_path / "state")
    assert refused.value.problem is KeyFileProblem.LOOSE_MODE and refused.value.path == key


@pytest.mark.parametrize("mode", [0o750, 0o755, 0o711, 0o701])
def test_files_key_folder_loose_mode_refused(tmp_path: pathlib.Path, mode: int) -> None:
    _keyring(tmp_path)
    os.chmod(tmp_path / "state" / "keys", mode)
    with pytest.raises(KeyFileError) as refused:
        KeyRing.open(tmp_path / "state")
    assert refused.value.problem is KeyFileProblem.LOOSE_MODE


def test_files_key_file_symlink_refused(tmp_path: pathlib.Path) -> None:
    key = _keyring(tmp_path)
    elsewhere = tmp_path / "elsewhere.paserk"
    key.rename(elsewhere)
    key.symlink_to(elsewhere)
    with pytest.raises(KeyFileError) as refused:
        KeyRing.open(tmp_path / "state")
    assert refused.value.problem is KeyFileProblem.SYMLINK


def test_files_key_folder_symlink_refused(tmp_path: pathlib.Path) -> None:
    _keyring(tmp_path)
    keys = tmp_path / "state" / "keys"
    keys.rename(tmp_path / "real-keys")
    keys.symlink_to(tmp_path / "real-keys")
    with pytest.raises(KeyFileError) as refused:
        KeyRing.open(tmp_path / "state")
    assert refused.value.problem is KeyFileProblem.SYMLINK


def test_files_key_dangling_symlink_not_followed_on_create(tmp_path: pathlib.Path) -> None:
    state = tmp_path / "state"
    (state / "keys").mkdir(parents=True, mode=0o700)
    target = tmp_path / "planted"
    (state / "keys" / "key-00000001.paserk").symlink_to(target)
    with pytest.raises(KeyFileError):
        KeyRing.open(state)
    assert not target.exists()


def test_files_key_fifo_refused_without_blocking(tmp_path: pathlib.Path) -> None:
    state = tmp_path / "state"
    (state / "keys").mkdir(parents=True, mode=0o700)
    os.mkfifo(state / "keys" / "key-00000001.paserk", 0o600)
    with pytest.raises(KeyFileError) as refused:
        KeyRing.open(state)
    assert refused.value.problem is KeyFileProblem.NOT_REGULAR


@pytest.mark.parametrize(
    "content",
    [b"", b"k4.secret.", b"k4.public.AAAA", b"\xff\xfe", b"k4.secret." + b"A" * 2000],
    ids=["empty", "bare_prefix", "public_key", "binary", "oversized"],
)
def test_files_key_file_malformed_refused(tmp_path: pathlib.Path, content: bytes) -> None:
    key = _keyring(tmp_path)
    key.write_bytes(content)
    with pytest.raises(KeyFileError) as refused:
        KeyRing.open(tmp_path / "state")
    assert refused.value.problem is KeyFileProblem.MALFORMED


# --- auth file ---------------------------------------------------------------------------


def _auth(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "auth.json"
    load_or_create_auth(path)
    return path


@pytest.mark.parametrize("mode", [m for m in LOOSE if m & 0o077], ids=lambda m: f"{m:04o}")
def test_files_auth_file_loose_mode_refused(tmp_path: pathlib.Path, mode: int) -> None:
    path = _auth(tmp_path)
    os.chmod(path, mode)
    with pytest.raises(AuthError, match=r"auth\.json"):
        load_auth(path)
    with pytest.raises(AuthError):
        load_or_create_auth(path)


def test_files_auth_file_symlink_refused(tmp_path: pathlib.Path) -> None:
    path = _auth(tmp_path)
    real = tmp_path / "real.json"
    path.rename(real)
    path.symlink_to(real)
    with pytest.raises(AuthError, match="symlink"):
        load_auth(path)


def test_files_auth_dangling_symlink_not_followed_on_create(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "auth.json"
    target = tmp_path / "planted.json"
    path.symlink_to(target)
    with pytest.raises(AuthError):
        load_or_create_auth(path)
    assert not target.exists(), "secrets were written through a planted symlink"


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{}",
        b'{"scheduler":"short","admin":"' + b"a" * 40 + b'"}',
        b'{"scheduler":"' + b"a" * 40 + b'","admin":"' + b"b" * 40 + b'","root":"x"}',
        b"[1]",
    ],
    ids=["empty", "no_roles", "short_secret", "unknown_role", "list"],
)
def test_files_auth_file_malformed_refused(tmp_path: pathlib.Path, content: bytes) -> None:
    path = _auth(tmp_path)
    path.write_bytes(content)
    with pytest.raises(AuthError):
        load_auth(path)


# --- journal -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [m for m in LOOSE if m & 0o077], ids=lambda m: f"{m:04o}")
def test_files_journal_loose_mode_refused(tmp_path: pathlib.Path, mode: int) -> None:
    journal, _ = Journal.open(tmp_path, durable=False)
    journal.close()
    os.chmod(tmp_path / JOURNAL_FILENAME, mode)
    with pytest.raises(JournalUnsafe) as refused:
        Journal.open(tmp_path, durable=False)
    assert refused.value.reason is UnsafeReason.OPEN_PERMISSIONS


def test_files_journal_symlink_refused(tmp_path: pathlib.Path) -> None:
    real = tmp_path / "real.journal"
    real.touch(mode=0o600)
    (tmp_path / JOURNAL_FILENAME).symlink_to(real)
    with pytest.raises(JournalUnsafe) as refused:
        Journal.open(tmp_path, durable=False)
    assert refused.value.reason is UnsafeReason.SYMLINK


def test_files_journal_dangling_symlink_not_followed(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "planted"
    (tmp_path / JOURNAL_FILENAME).symlink_to(target)
    with pytest.raises(JournalUnsafe):
        Journal.open(tmp_path, durable=False)
    assert not target.exists()


def test_files_journal_folder_instead_of_file_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / JOURNAL_FILENAME).mkdir()
    with pytest.raises(JournalUnsafe) as refused:
        Journal.open(tmp_path, durable=False)
    assert refused.value.reason is UnsafeReason.NOT_REGULAR_FILE


# --- the daemon refuses to start ---------------------------------------------------------


def _behind_a_symlink(path: pathlib.Path, real: pathlib.Path) -> pathlib.Path:
    """Moves the file to `real` and leaves a symlink to it in its place; returns `path`."""
    path.rename(real)
    path.symlink_to(real)
    return path


def _prepare(state: pathlib.Path, case: str) -> pathlib.Path:
    """A state dir made good by one clean start, then broken in one way; returns the file."""
    state.mkdir(mode=0o700)
    load_or_create_auth(state / "auth.json")
    KeyRing.open(state)
    journal, _ = Journal.open(state, durable=False)
    journal.close()
    auth = state / "auth.json"
    key = sorted((state / "keys").iterdir())[0]
    journal_path = state / JOURNAL_FILENAME
    if case == "auth_0644":
        os.chmod(auth, 0o644)
        return auth
    if case == "auth_symlink":
        return _behind_a_symlink(auth, state.parent / "real-auth.json")
    if case == "key_0640":
        os.chmod(key, 0o640)
        return key
    if case == "key_symlink":
        return _behind_a_symlink(key, state.parent / "real.paserk")
    if case == "journal_0644":
        os.chmod(journal_path, 0o644)
        return journal_path
    if case == "journal_symlink":
        return _behind_a_symlink(journal_path, state.parent / "real.journal")
    if case == "journal_flipped_byte":
        journal, _ = Journal.open(state, durable=False)
        for rid in ("one", "two"):
            journal.record_release(rid)  # any two whole records
        journal.close()
        data = bytearray(journal_path.read_bytes())
        data[9] ^= 0x40  # inside the first record's payload
        journal_path.write_bytes(bytes(data))
        return journal_path
    raise AssertionError(case)


def _serve(state: pathlib.Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        node_command(
            "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--devices", "none"
        ),
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    "case",
    [
        "auth_0644",
        "auth_symlink",
        "key_0640",
        "key_symlink",
        "journal_0644",
        "journal_symlink",
        "journal_flipped_byte",
    ],
)
def test_files_daemon_refuses_to_start_naming_the_file(tmp_path: pathlib.Path, case: str) -> None:
    state = tmp_path / "state"
    bad = _prepare(state, case)
    outside = tmp_path  # symlink targets live here, beside the state dir

    def fingerprint() -> dict[pathlib.Path, tuple[int, bytes]]:
        seen = {bad: (bad.lstat().st_mode, os.readlink(bad).encode() if bad.is_symlink() else b"")}
        for path in outside.iterdir():
            if path.is_file() and not path.is_symlink():
                seen[path] = (path.lstat().st_mode, path.read_bytes())
        return seen

    before = fingerprint()
    done = _serve(state)
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if "cannot start" in line]
    assert len(lines) == 1 and str(bad) in lines[0], done.stderr
    if case == "journal_flipped_byte":
        assert "corrupt at byte 0" in lines[0], lines[0]
    # The bad file (and whatever a symlink points at) was not rewritten or re-moded.
    assert fingerprint() == before
