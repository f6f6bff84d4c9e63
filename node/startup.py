"""The daemon's secrets at its start: the operator secrets, the key ring with a fresh
signing key, the telemetry bearer credential; and the error that stops a start."""

from __future__ import annotations

import pathlib

from api.auth import AuthError, AuthFile, load_or_create_auth
from capabilities import CapabilityError, KeyRing
from capabilities.push_signature import read_bearer_file
from capabilities.securefile import SecretFileError

__all__ = ["StartupError", "fresh_signing_key", "open_secrets", "telemetry_bearer"]


class StartupError(Exception):
    """The daemon cannot start (an unsafe state folder or key, auth or journal file, a
    flag it cannot serve here); exit 1."""


def fresh_signing_key(state_dir: pathlib.Path) -> KeyRing:
    """Open the key ring with a new signing key and every older key retired.

    Invocations do not survive a restart, so no token minted before it may
    verify after it: retiring the old keys refuses them all at once.
    """
    keyring = KeyRing.open(state_dir)
    keyring.rotate()
    for kid in keyring.kids():
        if kid != keyring.active_kid:
            keyring.retire(kid)
    return keyring


def open_secrets(
    state_dir: pathlib.Path, auth_path: pathlib.Path
) -> tuple[AuthFile, bool, KeyRing]:
    """The operator secrets and the key ring; StartupError names an unsafe file."""
    try:
        auth, created = load_or_create_auth(auth_path)
        return auth, created, fresh_signing_key(state_dir)
    except (OSError, AuthError, CapabilityError, SecretFileError) as exc:
        raise StartupError(str(exc)) from exc


def telemetry_bearer(path: str) -> str | None:
    """The telemetry bearer credential, if configured; StartupError for an unsafe file."""
    if not path:
        return None
    try:
        return read_bearer_file(pathlib.Path(path))
    except (SecretFileError, ValueError) as exc:
        raise StartupError(str(exc)) from exc
