"""How the client commands reach the local daemon: its URL and bearer secret come from
the address file in the state folder (`node.address`), and every request has a deadline.

Failures are `ClientError`: one line for stderr, exit status 1.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any

import httpx
import msgspec

from api.auth import AuthError, Role, load_auth
from api.errors import error_text
from node.address import AddressError, read_address
from node.config import Config

__all__ = ["REQUEST_SECONDS", "ClientError", "Target", "find_target", "request"]

# Longer than the daemon's own deadline for a cancel to release (about 40 s).
REQUEST_SECONDS = 60.0


class ClientError(Exception):
    """A client command cannot do what it was asked; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Target:
    url: str
    auth_file: pathlib.Path

    def secret(self, role: Role = Role.scheduler) -> str:
        try:
            return str(getattr(load_auth(self.auth_file), role.value))
        except AuthError as exc:
            raise ClientError(str(exc)) from exc


def find_target(config: Config, url: str = "") -> Target:
    """The daemon that uses `config.state_dir`. An explicit `url` skips the address file
    (the secrets are then in --auth-file or `<state-dir>/auth.json`)."""
    state_dir = pathlib.Path(config.state_dir)
    if url:
        default_auth = state_dir / "auth.json"
        return Target(url=url.rstrip("/"), auth_file=pathlib.Path(config.auth_file or default_auth))
    try:
        address = read_address(state_dir)
    except AddressError as exc:
        raise ClientError(f"{exc}; start one with `litegraph-node dev`") from exc
    return Target(url=address.url, auth_file=pathlib.Path(config.auth_file or address.auth_file))


def request(
    target: Target,
    method: str,
    path: str,
    *,
    role: Role = Role.scheduler,
    params: Sequence[tuple[str, str]] = (),
    timeout: float = REQUEST_SECONDS,
) -> Any:
    """One request with the role's secret; the decoded JSON of a 2xx answer."""
    headers = {"Authorization": f"Bearer {target.secret(role)}"}
    try:
        reply = httpx.request(
            method,
            target.url + path,
            headers=headers,
            params=tuple(params or ()),
            timeout=timeout,
        )
    except httpx.HTTPError as exc:
        raise ClientError(f"no daemon answers at {target.url}: {exc}") from exc
    if not reply.is_success:
        raise ClientError(f"{method} {path}: {reply.status_code} {error_text(reply.content)}")
    try:
        return msgspec.json.decode(reply.content)
    except msgspec.DecodeError as exc:
        raise ClientError(f"{method} {path}: not JSON: {exc}") from exc
