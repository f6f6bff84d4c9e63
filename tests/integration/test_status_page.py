"""The status page in headless Chromium against a real daemon on loopback.

Chromium is not installed by the test. Without it the test is skipped on a
workstation and fails under CI (the CI script installs the `chromium` package).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil

import httpx
import pytest
import trio

from tests.api_fixtures import bearer, builtin_request, get_snapshot, running_daemon

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_SECONDS = 60


def chromium() -> str:
    found = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is required under CI (apt-get install chromium)")
        pytest.skip("chromium is not installed")
    return found


async def dump_dom(browser: str, profile: pathlib.Path, url: str) -> str:
    argv = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=3000",
        "--dump-dom",
        url,
    ]
    # Run asynchronously: the daemon serving the page lives in this same trio run.
    with trio.fail_after(CHROMIUM_SECONDS):
        done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    return done.stdout.decode()


def table_body(dom: str, table_id: str) -> str:
    match = re.search(rf'<table id="{table_id}">.*?<tbody>(.*?)</tbody>', dom, re.DOTALL)
    assert match is not None, f"no #{table_id} table in the page"
    return match.group(1)


async def test_status_page_shows_devices_lanes_and_invocations(tmp_path: pathlib.Path) -> None:
    browser = chromium()
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        snapshot = await get_snapshot(client, node.scheduler)
        page = f"{node.url}/#token={node.scheduler}"
        dom = await dump_dom(browser, tmp_path / "profile-1", page)
        assert re.search(r'<form id="login" hidden', dom), "connected, yet the login form shows"
        devices = table_body(dom, "devices")
        for device in snapshot.devices:
            assert device.device_id in devices
            assert device.model in devices
        assert "24.0 GiB" in devices  # memory_total_bytes, formatted
        assert "NaN" not in dom and "undefined" not in dom
        lanes = table_body(dom, "lanes")
        for lane in snapshot.lanes:
            assert lane.lane_id in lanes
        assert "partitioned" in lanes and "dedicated, sandbox, shared" in lanes
        capacity = table_body(dom, "capacity")
        for vram in snapshot.capacity.vram_bytes:
            assert f"vram {vram.lane_id}" in capacity
        assert table_body(dom, "invocations").strip() == ""

        body = builtin_request("from-the-page-test", args={"seconds": 60})
        accepted = await client.post("/v1/invocations", json=body, headers=bearer(node.admin))
        assert accepted.status_code == 202
        dom = await dump_dom(browser, tmp_path / "profile-2", page)
        invocations = table_body(dom, "invocations")
        assert "from-the-page-test" in invocations
        assert re.search(r"(queued|running)</td>", invocations)


async def test_status_page_asks_for_a_token_when_the_one_given_is_wrong(
    tmp_path: pathlib.Path,
) -> None:
    browser = chromium()
    async with running_daemon(tmp_path) as node:
        dom = await dump_dom(browser, tmp_path / "profile", f"{node.url}/#token=wrong")
        assert re.search(r'<form id="login">', dom), "the login form should be shown"
        assert "not connected" in dom
        assert table_body(dom, "devices").strip() == ""
