"""The address file clients find the daemon by: what it holds, who may remove it."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from node.address import AddressError, client_url, read_address, remove_address, write_address


@pytest.mark.parametrize(
    ("bound", "dialled"),
    [
        ("http://0.0.0.0:7380", "http://127.0.0.1:7380"),
        ("http://[::]:81", "http://[::1]:81"),
        ("http://127.0.0.2:5", "http://127.0.0.2:5"),
        ("http://[::1]:5", "http://[::1]:5"),
    ],
)
def test_a_wildcard_bind_is_dialled_on_loopback(bound: str, dialled: str) -> None:
    assert client_url(bound) == dialled


def test_written_then_read_back(tmp_path: pathlib.Path) -> None:
    write_address(tmp_path, "http://0.0.0.0:9", tmp_path / "auth.json")
    address = read_address(tmp_path)
    assert (address.url, address.auth_file, address.pid) == (
        "http://127.0.0.1:9",
        str(tmp_path / "auth.json"),
        os.getpid(),
    )
    remove_address(tmp_path)
    with pytest.raises(AddressError, match="no daemon is running"):
        read_address(tmp_path)


def test_another_daemons_file_is_not_removed(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "address.json"
    path.write_text(json.dumps({"url": "http://127.0.0.1:1", "auth_file": "/a", "pid": 1}))
    path.chmod(0o600)
    remove_address(tmp_path)
    assert path.exists()


def test_a_symlinked_address_file_is_refused(tmp_path: pathlib.Path) -> None:
    real = tmp_path / "elsewhere.json"
    real.write_text(json.dumps({"url": "http://127.0.0.1:1", "auth_file": "/a", "pid": 1}))
    real.chmod(0o600)
    (tmp_path / "address.json").symlink_to(real)
    with pytest.raises(AddressError, match="symlink"):
        read_address(tmp_path)


def test_the_file_of_a_daemon_that_is_gone_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "address.json"
    path.write_text(json.dumps({"url": "http://127.0.0.1:1", "auth_file": "/a", "pid": 2**22 + 1}))
    path.chmod(0o600)
    with pytest.raises(AddressError, match=r"pid 4194305, which wrote .* is gone"):
        read_address(tmp_path)
