"""Where a running daemon can be reached: `<state-dir>/address.json`.

`serve` and `dev` write it (mode 0600, atomically) once they answer, and
remove it when they stop, so the client commands (`run`, `status`, ...) find
the URL and the auth file from `--state-dir` alone, whatever `--listen` and
`--auth-file` the daemon was given. It names where the secrets are, never a
secret. It is read like a secret file (ours, 0600, not a symlink) because what
it names decides where a client sends its bearer secret.
"""

from __future__ import annotations

import ipaddress
import os
import pathlib
import urllib.parse

import msgspec

from capabilities.securefile import SecretFileError, read_secret_file, write_secret_file

__all__ = [
    "ADDRESS_FILE",
    "Address",
    "AddressError",
    "client_url",
    "read_address",
    "remove_address",
    "write_address",
]

ADDRESS_FILE = "address.json"


class Address(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    url: str
    auth_file: str
    pid: int


class AddressError(Exception):
    """No usable address file: no daemon is running with this state folder."""


def client_url(bound: str) -> str:
    """The URL a local client dials: a wildcard bind (0.0.0.0, ::) is reached on loopback."""
    parts = urllib.parse.urlsplit(bound)
    host = parts.hostname or ""
    try:
        unspecified = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return bound
    if not unspecified:
        return bound
    loopback = "127.0.0.1" if ipaddress.ip_address(host).version == 4 else "[::1]"
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{loopback}:{parts.port}"))


def write_address(state_dir: pathlib.Path, url: str, auth_file: pathlib.Path) -> None:
    address = Address(url=client_url(url), auth_file=str(auth_file.absolute()), pid=os.getpid())
    write_secret_file(state_dir / ADDRESS_FILE, msgspec.json.encode(address) + b"\n")


def remove_address(state_dir: pathlib.Path) -> None:
    """Remove the file if this process wrote it (another daemon may have replaced it)."""
    path = state_dir / ADDRESS_FILE
    try:
        if _decode(path).pid == os.getpid():
            path.unlink()
    except (AddressError, OSError):
        pass


def read_address(state_dir: pathlib.Path) -> Address:
    path = state_dir / ADDRESS_FILE
    if not path.exists() and not path.is_symlink():
        raise AddressError(f"no daemon is running with state folder {state_dir} (no {path})")
    address = _decode(path)
    if not _alive(address.pid):
        # A daemon that was killed left its file: its port may belong to anyone now.
        raise AddressError(
            f"no daemon is running with state folder {state_dir}"
            f" (pid {address.pid}, which wrote {path}, is gone)"
        )
    return address


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, as another user
    return True


def _decode(path: pathlib.Path) -> Address:
    try:
        return msgspec.json.decode(read_secret_file(path, max_bytes=8192), type=Address)
    except SecretFileError as exc:
        raise AddressError(f"address file {exc}") from exc
    except msgspec.DecodeError as exc:
        raise AddressError(f"address file {path}: not valid: {exc}") from exc
