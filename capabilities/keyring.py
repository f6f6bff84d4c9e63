"""The node's Ed25519 signing keys, kept under `<state-dir>/keys/`.

Layout: one file per key, `key-<8-digit index>.paserk`, holding the key as a
PASERK `k4.secret` line, mode 0600, in a folder of mode 0700. The highest
index signs; every key present verifies. `rotate()` adds a key that signs
from then on; `retire(kid)` deletes a key, after which every token it signed
is refused (`unknown_key`).

Files are written atomically (temporary file, fsync, rename, fsync of the
folder). Opening the ring refuses, with `KeyFileError`, a key file or key
folder that is a symlink, not a regular file/folder, owned by someone else,
or readable by group or others: a secret that others could have read is not
a secret, and the daemon must not start on it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import stat

from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from capabilities.errors import KeyFileError, KeyFileProblem, KeyRingError
from capabilities.paseto import load_paserk_secret, paserk_pid, paserk_public, paserk_secret
from capabilities.securefile import (
    SecretFileError,
    SecretFileProblem,
    fsync_dir,
    read_secret_file,
    write_secret_file,
)

__all__ = ["KeyRing"]

KEYS_DIRNAME = "keys"
_KEY_NAME = re.compile(r"key-(\d{8})\.paserk")
_TEMP_NAME = re.compile(r"\.key-\d{8}\.paserk\.[0-9a-f]{8}\.tmp")
_MAX_KEY_FILE = 1024


@dataclasses.dataclass(frozen=True)
class _Key:
    index: int
    kid: str
    path: pathlib.Path
    secret: Ed25519PrivateKey
    public: Ed25519PublicKey


_PROBLEMS = {
    SecretFileProblem.symlink: KeyFileProblem.SYMLINK,
    SecretFileProblem.not_regular: KeyFileProblem.NOT_REGULAR,
    SecretFileProblem.wrong_owner: KeyFileProblem.WRONG_OWNER,
    SecretFileProblem.loose_mode: KeyFileProblem.LOOSE_MODE,
    SecretFileProblem.too_large: KeyFileProblem.MALFORMED,
    SecretFileProblem.unreadable: KeyFileProblem.UNREADABLE,
}


def _open_keys_dir(state_dir: pathlib.Path) -> pathlib.Path:
    directory = state_dir / KEYS_DIRNAME
    try:
        st = directory.lstat()
    except FileNotFoundError:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.mkdir(mode=0o700)
        os.chmod(directory, 0o700, follow_symlinks=False)
        st = directory.lstat()
    except OSError as exc:
        raise KeyFileError(directory, KeyFileProblem.UNREADABLE, str(exc)) from exc
    if stat.S_ISLNK(st.st_mode):
        raise KeyFileError(directory, KeyFileProblem.SYMLINK, "key folder is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise KeyFileError(directory, KeyFileProblem.NOT_REGULAR, "key folder is not a folder")
    if st.st_uid != os.geteuid():
        raise KeyFileError(
            directory, KeyFileProblem.WRONG_OWNER, f"key folder is owned by uid {st.st_uid}"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise KeyFileError(
            directory,
            KeyFileProblem.LOOSE_MODE,
            f"key folder has mode {stat.S_IMODE(st.st_mode):04o}; expected 0700 "
            "(chmod it, or rotate the keys if they may have leaked)",
        )
    return directory


def _read_key_file(path: pathlib.Path) -> Ed25519PrivateKey:
    try:
        raw = read_secret_file(path, max_bytes=_MAX_KEY_FILE)
    except SecretFileError as exc:
        raise KeyFileError(path, _PROBLEMS[exc.problem], f"key file {exc}") from None
    try:
        return load_paserk_secret(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError) as exc:
        raise KeyFileError(
            path, KeyFileProblem.MALFORMED, f"not a k4.secret PASERK: {exc}"
        ) from None


def _write_key_file(path: pathlib.Path, secret: Ed25519PrivateKey) -> None:
    """Write atomically, mode 0600, never through a symlink, never half a key."""
    write_secret_file(path, (paserk_secret(secret) + "\n").encode("ascii"))


class KeyRing:
    """The node's signing keys: the newest signs, all present verify."""

    def __init__(self, directory: pathlib.Path, keys: list[_Key]) -> None:
        """Use `KeyRing.open`; this constructor trusts its arguments."""
        if not keys:
            raise KeyRingError("a key ring needs at least one key")
        self._directory = directory
        self._keys: dict[str, _Key] = {}
        for key in sorted(keys, key=lambda k: k.index):
            self._keys[key.kid] = key
        self._active = max(keys, key=lambda k: k.index)
        self._generation = 0

    @classmethod
    def open(cls, state_dir: pathlib.Path) -> KeyRing:
        """Load (or create, with a first key) the ring under `state_dir/keys/`.

        Raises KeyFileError when the folder or any key file is unsafe or
        unreadable; nothing is loaded in that case.
        """
        directory = _open_keys_dir(state_dir)
        keys: list[_Key] = []
        seen: set[str] = set()
        for entry in sorted(os.listdir(directory)):
            path = directory / entry
            if _TEMP_NAME.fullmatch(entry):
                path.unlink(missing_ok=True)  # a write that never finished
                continue
            match = _KEY_NAME.fullmatch(entry)
            if match is None:
                continue
            secret = _read_key_file(path)
            public = secret.public_key()
            kid = paserk_pid(public)
            if kid in seen:
                raise KeyFileError(path, KeyFileProblem.MALFORMED, f"duplicate of key {kid}")
            seen.add(kid)
            keys.append(_Key(int(match.group(1)), kid, path, secret, public))
        if not keys:
            keys.append(cls._create(directory, 1))
        return cls(directory, keys)

    @staticmethod
    def _create(directory: pathlib.Path, index: int) -> _Key:
        secret = Ed25519PrivateKey.generate()
        path = directory / f"key-{index:08d}.paserk"
        _write_key_file(path, secret)
        public = secret.public_key()
        return _Key(index, paserk_pid(public), path, secret, public)

    @property
    def directory(self) -> pathlib.Path:
        return self._directory

    @property
    def active_kid(self) -> str:
        """The key id (PASERK k4.pid) of the key that signs new tokens."""
        return self._active.kid

    @property
    def generation(self) -> int:
        """Bumped whenever a key stops verifying; caches of verified tokens watch it."""
        return self._generation

    def kids(self) -> list[str]:
        """Every key id that verifies, oldest first."""
        return list(self._keys)

    def signing_key(self) -> tuple[str, Ed25519PrivateKey]:
        """(kid, secret key) of the key that signs new tokens."""
        return self._active.kid, self._active.secret

    def public_key(self, kid: str) -> Ed25519PublicKey | None:
        """The verifying key for `kid`, or None when the ring does not hold it."""
        key = self._keys.get(kid)
        return None if key is None else key.public

    def rotate(self) -> str:
        """Add a key that signs from now on; older keys still verify. Returns its kid."""
        key = self._create(self._directory, self._active.index + 1)
        self._keys[key.kid] = key
        self._active = key
        return key.kid

    def retire(self, kid: str) -> None:
        """Delete a key: every token it signed is refused from now on.

        The signing key cannot be retired; rotate first.
        """
        key = self._keys.get(kid)
        if key is None:
            raise KeyRingError(f"no key {kid} in the ring")
        if key is self._active:
            raise KeyRingError(f"key {kid} signs new tokens; rotate before retiring it")
        # Disk first: if this fails the key stays fully in service, never half-retired.
        key.path.unlink(missing_ok=True)
        fsync_dir(self._directory)
        del self._keys[kid]
        self._generation += 1

    def public_paserks(self) -> dict[str, str]:
        """kid -> PASERK k4.public of every key that verifies, for other verifiers."""
        return {kid: paserk_public(key.public) for kid, key in self._keys.items()}
