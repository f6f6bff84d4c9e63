"""Operator authentication: bearer secrets for the roles `scheduler` and `admin`.

The secrets live in a JSON file (`--auth-file`, default `<state-dir>/auth.json`)
that must be a regular file of mode 0600 owned by us; `dev` creates it on
first run. The two secrets must differ, or the daemon refuses to start.
Comparison is constant-time and checks every role, so timing says nothing
about which secret came close.
"""

from __future__ import annotations

import enum
import hmac
import pathlib
import secrets

import msgspec

from api.errors import ApiError
from capabilities.securefile import SecretFileError, read_secret_file, write_secret_file

__all__ = ["AuthError", "AuthFile", "Authenticator", "Role", "load_auth", "load_or_create_auth"]

_MIN_SECRET_CHARS = 32


class Role(enum.StrEnum):
    scheduler = "scheduler"
    admin = "admin"


class AuthFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    scheduler: str
    admin: str


class AuthError(Exception):
    """The auth file cannot be used; the daemon refuses to start."""


def load_auth(path: pathlib.Path) -> AuthFile:
    try:
        auth = msgspec.json.decode(read_secret_file(path), type=AuthFile)
    except SecretFileError as exc:
        raise AuthError(f"auth file {exc}") from exc
    except msgspec.DecodeError as exc:
        raise AuthError(f"auth file {path}: not valid: {exc}") from exc
    for role in Role:
        if len(getattr(auth, role.value)) < _MIN_SECRET_CHARS:
            raise AuthError(f"auth file {path}: the {role} secret is shorter than 32 characters")
    # One secret for both roles would hand the scheduler the admin's powers (drain).
    if hmac.compare_digest(auth.scheduler.encode(), auth.admin.encode()):
        raise AuthError(
            f"auth file {path}: the scheduler and admin secrets are the same; "
            "give each role its own secret"
        )
    return auth


def load_or_create_auth(path: pathlib.Path) -> tuple[AuthFile, bool]:
    """(secrets, created): creates the file with fresh secrets when it is absent."""
    if not path.exists() and not path.is_symlink():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fresh = AuthFile(scheduler=secrets.token_urlsafe(32), admin=secrets.token_urlsafe(32))
        write_secret_file(path, msgspec.json.format(msgspec.json.encode(fresh)) + b"\n")
        return fresh, True
    return load_auth(path), False


class Authenticator:
    def __init__(self, auth: AuthFile) -> None:
        self._secrets = {Role.scheduler: auth.scheduler.encode(), Role.admin: auth.admin.encode()}

    def role_of(self, header: str | None) -> Role | None:
        if not header or not header.startswith("Bearer "):
            return None
        presented = header[len("Bearer ") :].strip().encode()
        found = None
        for role, secret in self._secrets.items():
            if hmac.compare_digest(presented, secret):
                found = role
        return found

    def require(self, header: str | None, allowed: frozenset[Role]) -> Role:
        role = self.role_of(header)
        if role is None:
            raise ApiError(
                401,
                "unauthenticated",
                "a valid operator bearer credential is required",
                headers={"WWW-Authenticate": 'Bearer realm="litegraph-node"'},
            )
        if role not in allowed:
            raise ApiError(
                403, "forbidden", f"role {role} may not do this", {"allowed": sorted(allowed)}
            )
        return role
