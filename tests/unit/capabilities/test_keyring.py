"""The key ring on disk: creation, modes, refusal of unsafe files, rotation, retirement."""

from __future__ import annotations

import os
import pathlib
import stat

import pytest

from capabilities import KeyFileError, KeyFileProblem, KeyRing, KeyRingError, paseto


def _mode(path: pathlib.Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _key_files(ring: KeyRing) -> list[pathlib.Path]:
    return sorted(ring.directory.glob("key-*.paserk"))


def test_open_creates_the_folder_and_a_first_key(tmp_path: pathlib.Path) -> None:
    ring = KeyRing.open(tmp_path / "state")
    assert ring.directory == tmp_path / "state" / "keys"
    assert _mode(ring.directory) == 0o700
    [key_file] = _key_files(ring)
    assert _mode(key_file) == 0o600
    assert key_file.read_text().startswith("k4.secret.")
    assert ring.kids() == [ring.active_kid]
    assert ring.active_kid.startswith("k4.pid.")


def test_reopening_loads_the_same_keys(tmp_path: pathlib.Path) -> None:
    first = KeyRing.open(tmp_path)
    second_kid = first.rotate()
    again = KeyRing.open(tmp_path)
    assert again.kids() == first.kids()
    assert again.active_kid == second_kid
    assert again.public_paserks() == first.public_paserks()


def test_public_paserks_are_k4_public_matching_their_kid(tmp_path: pathlib.Path) -> None:
    ring = KeyRing.open(tmp_path)
    ring.rotate()
    exported = ring.public_paserks()
    assert set(exported) == set(ring.kids())
    for kid, text in exported.items():
        assert text.startswith("k4.public.")
        assert paseto.paserk_pid(paseto.load_paserk_public(text)) == kid
    assert "k4.secret" not in repr(exported)


def test_rotation_signs_with_the_new_key_and_keeps_the_old_one(tmp_path: pathlib.Path) -> None:
    ring = KeyRing.open(tmp_path)
    old = ring.active_kid
    new = ring.rotate()
    assert new != old
    assert ring.active_kid == new
    assert ring.signing_key()[0] == new
    assert ring.public_key(old) is not None
    assert ring.kids() == [old, new]
    assert len(_key_files(ring)) == 2
    assert all(_mode(p) == 0o600 for p in _key_files(ring))


def test_retire_deletes_the_key_and_bumps_the_generation(tmp_path: pathlib.Path) -> None:
    ring = KeyRing.open(tmp_path)
    old = ring.active_kid
    ring.rotate()
    generation = ring.generation
    ring.retire(old)
    assert ring.public_key(old) is None
    assert old not in ring.public_paserks()
    assert ring.generation == generation + 1
    assert len(_key_files(ring)) == 1
    assert old not in KeyRing.open(tmp_path).kids()  # stays retired across restarts


def test_the_signing_key_cannot_be_retired(tmp_path: pathlib.Path) -> None:
    ring = KeyRing.open(tmp_path)
    with pytest.raises(KeyRingError, match="rotate"):
        ring.retire(ring.active_kid)
    with pytest.raises(KeyRingError, match="no key"):
        ring.retire("k4.pid." + "A" * 44)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666])
def test_a_key_file_others_can_read_is_refused(tmp_path: pathlib.Path, mode: int) -> None:
    ring = KeyRing.open(tmp_path)
    [key_file] = _key_files(ring)
    key_file.chmod(mode)
    with pytest.raises(KeyFileError) as refused:
        KeyRing.open(tmp_path)
    assert refused.value.problem is KeyFileProblem.LOOSE_MODE
    assert refused.value.path == key_file
    assert f"{mode:04o}" in str(refused.value)


def test_a_key_folder_others_can_read_is_refused(tmp_path: pathlib.Path) -> None:
    ring = KeyRing.open(tmp_path)
    ring.directory.chmod(0o755)
    with pytest.raises(KeyFileError) as refused:
        KeyRing.open(tmp_path)
    assert refused.value.problem is KeyFileProblem.LOOSE_MODE


def test_a_key_file_that_is_a_symlink_is_refused(tmp_path: pathlib.Path) -> None:
    ring = KeyRing.open(tmp_path / "state")
    [key_file] = _key_files(ring)
    elsewhere = tmp_path / "elsewhere.paserk"
    key_file.rename(elsewhere)
    key_file.symlink_to(elsewhere)
    with pytest.raises(KeyFileError) as refused:
        KeyRing.open(tmp_path / "state")
    assert refused.value.problem is KeyFileProblem.SYMLINK


def test_a_key_folder_that_is_a_symlink_is_refused(tmp_path: pathlib.Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "keys").symlink_to(real)
    with pytest.raises(KeyFileError) as refused:
        KeyRing.open(tmp_path / "state")
    assert refused.value.problem is KeyFileProblem.SYMLINK


def test_a_key_path_that_is_not_a_regular_file_is_refused(tmp_path: pathlib.Path) -> None:
    ring = KeyRing.open(tmp_path)
    (ring.directory / "key-00000009.paserk").mkdir(mode=0o700)
    with pytest.raises(KeyFileError) as refused:
        KeyRing.open(tmp_path)
    assert refused.value.problem is KeyFileProblem.NOT_REGULAR


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"not a paserk\n",
        b"k4.public.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA\n",
        b"\xff" * 10,
    ],
)
def test_a_malformed_key_file_is_refused(tmp_path: pathlib.Path, content: bytes) -> None:
    ring = KeyRing.open(tmp_path)
    path = ring.directory / "key-00000002.paserk"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(KeyFileError) as refused:
        KeyRing.open(tmp_path)
    assert refused.value.problem is KeyFileProblem.MALFORMED


def test_a_duplicated_key_file_is_refused(tmp_path: pathlib.Path) -> None:
    ring = KeyRing.open(tmp_path)
    [key_file] = _key_files(ring)
    copy = ring.directory / "key-00000005.paserk"
    fd = os.open(copy, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, key_file.read_bytes())
    os.close(fd)
    with pytest.raises(KeyFileError) as refused:
        KeyRing.open(tmp_path)
    assert refused.value.problem is KeyFileProblem.MALFORMED


def test_leftover_temporary_files_are_removed_and_other_files_ignored(
    tmp_path: pathlib.Path,
) -> None:
    ring = KeyRing.open(tmp_path)
    leftover = ring.directory / ".key-00000002.paserk.0123abcd.tmp"
    leftover.write_bytes(b"half a key")
    (ring.directory / "README").write_text("not a key")
    again = KeyRing.open(tmp_path)
    assert not leftover.exists()
    assert again.kids() == ring.kids()


def test_a_missing_state_dir_is_created(tmp_path: pathlib.Path) -> None:
    ring = KeyRing.open(tmp_path / "a" / "b")
    assert ring.directory.is_dir()
    assert _mode(ring.directory) == 0o700


def test_key_files_are_created_0600_whatever_the_umask(tmp_path: pathlib.Path) -> None:
    previous = os.umask(0o000)
    try:
        ring = KeyRing.open(tmp_path)
        ring.rotate()
    finally:
        os.umask(previous)
    assert _mode(ring.directory) == 0o700
    assert all(_mode(p) == 0o600 for p in _key_files(ring))


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file away")
def test_a_key_file_owned_by_someone_else_is_refused(tmp_path: pathlib.Path) -> None:
    ring = KeyRing.open(tmp_path)
    [key_file] = _key_files(ring)
    os.chown(key_file, 54321, -1)
    with pytest.raises(KeyFileError) as refused:
        KeyRing.open(tmp_path)
    assert refused.value.problem is KeyFileProblem.WRONG_OWNER
