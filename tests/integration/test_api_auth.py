"""The operator auth matrix over real HTTP, and an unsafe auth file refusing start-up."""

from __future__ import annotations

import os
import pathlib
import secrets
import subprocess

import httpx
import msgspec
import pytest
import trio

from api.errors import ErrorEnvelope
from node.daemon import Daemon, StartupError
from tests.api_fixtures import bearer, builtin_request, daemon_config, running_daemon
from tests.helpers import clean_env, node_command

# (method, path, admin only); ids that must exist are filled in per test.
OPERATOR_ENDPOINTS = [
    ("GET", "/v1/snapshot", False),
    ("GET", "/v1/invocations", False),
    ("GET", "/v1/invocations/known", False),
    ("DELETE", "/v1/invocations/known", False),
    ("POST", "/v1/lanes/{lane}/drain", True),
    ("POST", "/v1/lanes/{lane}/resume", True),
]


def error_code(reply: httpx.Response) -> str:
    return msgspec.json.decode(reply.content, type=ErrorEnvelope).error.code


async def test_auth_matrix(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        body = builtin_request("known", args={"seconds": 60})
        accepted = await client.post("/v1/invocations", json=body, headers=bearer(node.admin))
        assert accepted.status_code == 202
        lane, capability = next(iter(accepted.json()["tokens"].items()))
        near_miss = node.scheduler[:-1] + ("A" if node.scheduler[-1] != "A" else "B")
        for method, template, admin_only in OPERATOR_ENDPOINTS:
            path = template.format(lane=lane)
            anonymous = await client.request(method, path)
            assert anonymous.status_code == 401, (method, path)
            assert error_code(anonymous) == "unauthenticated"
            assert anonymous.headers["WWW-Authenticate"].startswith("Bearer")
            for wrong in (near_miss, secrets.token_urlsafe(32), capability, "x"):
                reply = await client.request(
                    method, path, headers={"Authorization": f"Bearer {wrong}"}
                )
                assert reply.status_code == 401, (method, path, wrong[:12])
            basic = await client.request(method, path, headers={"Authorization": node.admin})
            assert basic.status_code == 401  # the scheme is required
            as_scheduler = await client.request(method, path, headers=bearer(node.scheduler))
            if admin_only:
                assert as_scheduler.status_code == 403, (method, path)
                assert error_code(as_scheduler) == "forbidden"
            else:
                assert as_scheduler.status_code == 200, (method, path, as_scheduler.text)
            as_admin = await client.request(method, path, headers=bearer(node.admin))
            assert as_admin.status_code == 200, (method, path, as_admin.text)
        # The submission itself follows the same rules.
        anonymous = await client.post("/v1/invocations", json=builtin_request("a2"))
        assert anonymous.status_code == 401
        as_token = await client.post(
            "/v1/invocations", json=builtin_request("a2"), headers=bearer(capability)
        )
        assert as_token.status_code == 401
        for secret in (node.scheduler, node.admin):
            events = await client.get("/v1/events", headers=bearer(capability))
            assert events.status_code == 401
            # An operator secret is no capability token for lane work.
            work = await client.post(
                f"/v1/lanes/{lane}/work",
                json={"op": "execute", "kernel": "noop"},
                headers=bearer(secret),
            )
            assert work.status_code == 401 and error_code(work) != "ok"
        # Probes and the documents stay open.
        for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
            assert (await client.get(path)).status_code == 200, path


def _write_auth(path: pathlib.Path, mode: int) -> None:
    text = msgspec.json.encode({"scheduler": "s" * 40, "admin": "a" * 40})
    path.write_bytes(text)
    path.chmod(mode)


async def _refused_start(tmp_path: pathlib.Path, auth_path: pathlib.Path) -> str:
    config = daemon_config(tmp_path, "--auth-file", str(auth_path))
    daemon = Daemon(config, handle_signals=False)
    with pytest.raises(StartupError) as refused, trio.fail_after(20):
        await daemon.run()  # a bare StartupError, not one wrapped in exception groups
    return str(refused.value)


async def test_group_readable_auth_file_refuses_start(tmp_path: pathlib.Path) -> None:
    auth_path = tmp_path / "auth.json"
    _write_auth(auth_path, 0o644)
    message = await _refused_start(tmp_path, auth_path)
    assert str(auth_path) in message


async def test_symlinked_auth_file_refuses_start(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "real-auth.json"
    _write_auth(target, 0o600)
    link = tmp_path / "auth.json"
    link.symlink_to(target)
    message = await _refused_start(tmp_path, link)
    assert str(link) in message


async def test_identical_scheduler_and_admin_secrets_refuse_start(tmp_path: pathlib.Path) -> None:
    """One secret for both roles would let the scheduler drain lanes."""
    auth_path = tmp_path / "auth.json"
    same = "s" * 40
    auth_path.write_bytes(msgspec.json.encode({"scheduler": same, "admin": same}))
    auth_path.chmod(0o600)
    message = await _refused_start(tmp_path, auth_path)
    assert str(auth_path) in message and "same" in message
    assert "\n" not in message and same not in message


def _serve_with_auth_file(
    tmp_path: pathlib.Path,
) -> tuple[pathlib.Path, subprocess.CompletedProcess[str]]:
    auth_path = tmp_path / "auth.json"
    _write_auth(auth_path, 0o644)
    return auth_path, subprocess.run(
        node_command(
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            str(tmp_path / "state"),
            "--devices",
            "none",
            "--auth-file",
            str(auth_path),
        ),
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
        check=False,
    )


def test_cli_exits_1_naming_an_unsafe_auth_file(tmp_path: pathlib.Path) -> None:
    auth_path, result = _serve_with_auth_file(tmp_path)
    assert result.returncode == 1, result.stderr
    assert str(auth_path) in result.stderr


def test_cli_says_cannot_start_in_one_line(tmp_path: pathlib.Path) -> None:
    auth_path, result = _serve_with_auth_file(tmp_path)
    assert "Traceback" not in result.stderr
    assert f"litegraph-node: cannot start: auth file {auth_path}" in result.stderr


def test_auth_file_created_by_the_daemon_is_0600(tmp_path: pathlib.Path) -> None:
    async def start_and_stop() -> pathlib.Path:
        async with running_daemon(tmp_path) as node:
            return node.daemon.auth_path

    path = trio.run(start_and_stop)
    assert path.is_file() and not path.is_symlink()
    assert os.stat(path).st_mode & 0o777 == 0o600
