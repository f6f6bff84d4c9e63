"""The status page in headless Chromium against a real daemon on loopback.

Chromium is not installed by the test. Without it the test is skipped on a
workstation and fails under CI (the CI script installs the `chromium` package).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio

from tests import cdp
from tests.api_fixtures import (
    RunningDaemon,
    bearer,
    builtin_request,
    get_snapshot,
    running_daemon,
)
from tests.helpers import guest_cwd

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_SECONDS = 60


def chromium() -> str:
    found = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is required under CI (apt-get install chromium)")
        pytest.skip("chromium is not installed")
    return found


@contextlib.asynccontextmanager
async def serving(
    tmp_path: pathlib.Path, *argv: str
) -> AsyncIterator[tuple[RunningDaemon, httpx.AsyncClient]]:
    """A daemon on loopback and an HTTP client for it."""
    async with (
        running_daemon(tmp_path, *argv) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        yield node, client


async def dump_dom(browser: str, profile: pathlib.Path, url: str) -> str:
    argv = [
        browser,
        *cdp.FLAGS,
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
    async with serving(tmp_path) as (node, client):
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
        # What it runs, how long it has, on which lane.
        assert "<code>builtin:sleep</code>" in invocations
        assert re.search(r"<td>\d+\.\d\d s</td>", invocations), invocations
        assert re.search(r"<td>cpu lane_[0-9a-f]{16}</td>", invocations), invocations


async def test_status_page_asks_for_a_token_when_the_one_given_is_wrong(
    tmp_path: pathlib.Path,
) -> None:
    browser = chromium()
    async with running_daemon(tmp_path) as node:
        dom = await dump_dom(browser, tmp_path / "profile", f"{node.url}/#token=wrong")
        assert re.search(r'<form id="login">', dom), "the login form should be shown"
        assert "not connected" in dom
        assert table_body(dom, "devices").strip() == ""


def row(dom: str, table_id: str, key: str) -> str:
    """The <tr> of `table_id` whose data attribute or text holds `key`."""
    for match in re.finditer(r"<tr[^>]*>.*?</tr>", table_body(dom, table_id), re.DOTALL):
        if key in match.group(0):
            return match.group(0)
    raise AssertionError(f"no row with {key!r} in #{table_id}")


async def test_devices_show_their_readings_and_a_history_at_once(tmp_path: pathlib.Path) -> None:
    browser = chromium()
    async with serving(tmp_path, "--health-interval", "0.05") as (node, client):
        with trio.fail_after(10):  # a few probes, so there is a history to show
            while True:
                reply = await client.get("/v1/devices/history", headers=bearer(node.scheduler))
                assert reply.status_code == 200, reply.text
                history = reply.json()
                if min(len(d["samples"]) for d in history["devices"]) >= 3:
                    break
                await trio.sleep(0.05)
        assert history["max_samples"] == 120 and history["interval_s"] == 0.05
        dom = await dump_dom(browser, tmp_path / "profile", f"{node.url}/#token={node.scheduler}")
    first = row(dom, "devices", "GPU-5e1d0a3c-0000-4000-8000-5157a0000001")
    assert "41 °C" in first and "72 W" in first  # the simulated workstation's readings
    assert re.search(r"\d+ MiB / 24\.0 GiB|[\d.]+ GiB / 24\.0 GiB", first), first
    # The graphs are drawn from the server's ring, with no wait for new samples.
    label = re.search(r'aria-label="temperature over the last (\d+) samples', first)
    assert label is not None and int(label.group(1)) >= 3, first
    assert "<polyline" in first


async def test_history_needs_an_operator(tmp_path: pathlib.Path) -> None:
    async with serving(tmp_path) as (_, client):
        assert (await client.get("/v1/devices/history")).status_code == 401
        wrong = await client.get("/v1/devices/history", headers=bearer("x" * 40))
        assert wrong.status_code == 401


HEALTHY_GPU = "GPU-5e1d0a3c-0000-4000-8000-00000000000a"
UNHEALTHY_GPU = "GPU-5e1d0a3c-0000-4000-8000-00000000000b"
TWO_GPUS = f"""
[cpu]
logical_cores = 4
[memory]
total = "8GiB"
[[gpus]]
uuid = "{HEALTHY_GPU}"
name = "SimGPU A"
memory = "8GiB"
[[gpus]]
uuid = "{UNHEALTHY_GPU}"
name = "SimGPU B"
memory = "8GiB"
[[faults]]
at = 0.0
gpu = "{UNHEALTHY_GPU}"
kind = "over_temperature"
temperature_c = 97.0
"""


async def test_drained_and_unhealthy_lanes_never_look_free(tmp_path: pathlib.Path) -> None:
    browser = chromium()
    sim = tmp_path / "sim.toml"
    sim.write_text(TWO_GPUS)
    argv = ("--sim-file", str(sim), "--health-interval", "0.1")
    async with serving(tmp_path, *argv) as (node, client):
        with trio.fail_after(10):
            while True:
                snapshot = await get_snapshot(client, node.scheduler)
                sick = [lane for lane in snapshot.lanes if lane.device_id == UNHEALTHY_GPU]
                if sick and sick[0].health == "unhealthy":
                    break
                await trio.sleep(0.05)
        (drained,) = [lane for lane in snapshot.lanes if lane.device_id == HEALTHY_GPU]
        reply = await client.post(f"/v1/lanes/{drained.lane_id}/drain", headers=bearer(node.admin))
        assert reply.status_code == 200, reply.text
        dom = await dump_dom(browser, tmp_path / "profile", f"{node.url}/#token={node.scheduler}")
    lane = row(dom, "lanes", drained.lane_id)
    assert 'class="badge drained">DRAINED — takes no work' in lane, lane
    assert 'class="bar out drained"' in lane
    lane = row(dom, "lanes", sick[0].lane_id)
    assert 'class="badge unhealthy">UNHEALTHY — takes no work' in lane, lane
    vram = row(dom, "capacity", f"vram {drained.lane_id}")
    assert 'class="bar out drained"' in vram and "DRAINED" in vram, vram
    vram = row(dom, "capacity", f"vram {sick[0].lane_id}")
    assert 'class="bar out unhealthy"' in vram and "UNHEALTHY" in vram, vram
    cpu = row(dom, "lanes", ">cpu<")
    assert 'class="badge available">available' in cpu, cpu


async def test_the_page_says_when_devices_are_simulated(tmp_path: pathlib.Path) -> None:
    browser = chromium()
    async with running_daemon(tmp_path / "sim") as node:
        dom = await dump_dom(browser, tmp_path / "p1", f"{node.url}/#token={node.scheduler}")
    assert re.search(r'<div id="sim-banner" class="banner" role="alert">', dom), "no banner"
    assert "Simulated devices." in dom and "--devices sim" in dom
    async with running_daemon(tmp_path / "none", devices="none") as node:
        dom = await dump_dom(browser, tmp_path / "p2", f"{node.url}/#token={node.scheduler}")
    assert re.search(r'<div id="sim-banner" class="banner" role="alert" hidden', dom)


class _BrokenNvml:
    """A pynvml whose driver is not loaded."""

    class NVMLError(Exception):
        pass

    def nvmlInit(self) -> None:
        raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        pass


async def test_the_page_says_why_dev_fell_back_to_simulated_devices(
    tmp_path: pathlib.Path,
) -> None:
    browser = chromium()
    async with running_daemon(
        tmp_path, devices="auto", dev=True, pynvml_module=_BrokenNvml()
    ) as node:
        dom = await dump_dom(browser, tmp_path / "p", f"{node.url}/#token={node.scheduler}")
    banner = re.search(r'<div id="sim-banner"[^>]*>(.*?)</div>', dom, re.DOTALL)
    assert banner is not None and " hidden" not in banner.group(0).split(">")[0]
    assert "NVMLError: Driver Not Loaded" in banner.group(1), banner.group(1)


async def _ended(client: httpx.AsyncClient, secret: str, invocation_id: str) -> dict[str, Any]:
    with trio.fail_after(20):
        while True:
            reply = await client.get(f"/v1/invocations/{invocation_id}", headers=bearer(secret))
            status: dict[str, Any] = reply.json()
            if status["state"] not in ("queued", "running"):
                return status
            await trio.sleep(0.05)


async def test_invocation_detail_shows_exit_code_reason_usage_and_stderr(
    tmp_path: pathlib.Path,
) -> None:
    browser = chromium()
    async with serving(tmp_path) as (node, client):
        body = {
            "id": "oom-job",
            "work": {
                "kind": "process",
                "argv": [
                    "sh",
                    "-c",
                    "echo step 1; echo 'RuntimeError: CUDA out of memory' >&2; exit 3",
                ],
                "cwd": str(guest_cwd()),
            },
            "resources": {"cpu_millis": 100, "memory_bytes": 2**26},
        }
        accepted = await client.post("/v1/invocations", json=body, headers=bearer(node.scheduler))
        assert accepted.status_code == 202, accepted.text
        status = await _ended(client, node.scheduler, "oom-job")
        assert status["exit_code"] == 3, status
        page = f"{node.url}/#token={node.scheduler}&inv=oom-job"
        dom = await dump_dom(browser, tmp_path / "profile", page)
    detail = re.search(r'<section id="detail"[^>]*>(.*?)</section>', dom, re.DOTALL)
    assert detail is not None and " hidden" not in detail.group(0).split(">")[0], "no detail"
    text = detail.group(1)
    assert 'data-field="exit_code">3<' in text, text
    assert re.search(r'data-field="command"><code>sh -c "echo step 1; ', text), text
    assert re.search(r'data-field="duration">\d+\.\d\d s<', text), text
    assert 'data-field="resources">0.1 cores · 64 MiB · 0 GPUs · 0 MiB VRAM<' in text, text
    assert re.search(r'data-field="lanes">cpu lane_[0-9a-f]{16}<', text), text
    assert 'data-field="reason">nonzero_exit<' in text
    assert re.search(r'data-field="cpu">\d+\.\d\d s<', text), text
    assert "RuntimeError: CUDA out of memory" in re.sub(r"\s+", " ", text)
    assert "step 1" in text
    assert re.search(r"<td>3</td>", row(dom, "invocations", "oom-job"))  # the exit column


async def _drained(client: httpx.AsyncClient, secret: str, lane_id: str) -> bool:
    snapshot = await get_snapshot(client, secret)
    return next(lane.drained for lane in snapshot.lanes if lane.lane_id == lane_id)


async def _sign_in(tab: cdp.Page, url: str, secret: str) -> None:
    """Open the page with no secret in its address and paste `secret` into the form."""
    await tab.goto(f"{url}/")
    await tab.wait_for("!document.querySelector('#login').hidden")
    await tab.evaluate(
        f"document.querySelector('#token').value = {json.dumps(secret)};"
        " document.querySelector('#login').requestSubmit(); true"
    )
    await tab.wait_for("document.querySelector('#role').textContent.startsWith('signed in')")


async def test_an_admin_signs_in_on_the_page_and_drains_then_resumes_a_lane(
    tmp_path: pathlib.Path,
) -> None:
    browser = chromium()
    async with serving(tmp_path) as (node, client), cdp.page(browser, tmp_path / "profile") as tab:
        lane = (await get_snapshot(client, node.scheduler)).lanes[-1].lane_id
        button = f"document.querySelector('tr[data-lane=\"{lane}\"] button.lane-action')"
        await _sign_in(tab, node.url, node.admin)
        await tab.wait_for(f"{button}?.dataset.action === 'drain'")
        assert await tab.evaluate("document.querySelector('#role').textContent") == (
            "signed in as admin"
        )
        await tab.evaluate(f"{button}.click(); true")
        await tab.wait_for(f"{button}?.dataset.action === 'resume'")
        assert await _drained(client, node.scheduler, lane)
        badge = f"document.querySelector('tr[data-lane=\"{lane}\"] .badge').textContent"
        assert await tab.evaluate(badge) == "DRAINED — takes no work"
        await tab.evaluate(f"{button}.click(); true")
        await tab.wait_for(f"{button}?.dataset.action === 'drain'")
        assert not await _drained(client, node.scheduler, lane)
        # The secret stays in the tab, never in its address.
        assert node.admin not in await tab.evaluate("location.href")


async def test_a_scheduler_gets_no_drain_button_and_is_refused(tmp_path: pathlib.Path) -> None:
    browser = chromium()
    async with serving(tmp_path) as (node, client):
        dom = await dump_dom(browser, tmp_path / "profile", f"{node.url}/#token={node.scheduler}")
        assert "signed in as scheduler" in dom
        assert "lane-action" not in table_body(dom, "lanes")
        lane = (await get_snapshot(client, node.scheduler)).lanes[-1].lane_id
        reply = await client.post(f"/v1/lanes/{lane}/drain", headers=bearer(node.scheduler))
        assert reply.status_code == 403, reply.text
        assert not await _drained(client, node.scheduler, lane)


async def test_an_admin_secret_in_the_address_is_refused(tmp_path: pathlib.Path) -> None:
    browser = chromium()
    async with running_daemon(tmp_path) as node:
        dom = await dump_dom(browser, tmp_path / "profile", f"{node.url}/#token={node.admin}")
    assert re.search(r'<form id="login">', dom), "the login form should be shown"
    assert "an admin secret in a URL is refused" in dom
    assert "lane-action" not in table_body(dom, "lanes")
    assert node.admin not in dom


async def test_the_page_cannot_be_framed_or_reach_elsewhere_and_a_cross_site_post_drains_nothing(
    tmp_path: pathlib.Path,
) -> None:
    async with serving(tmp_path) as (node, client):
        page = await client.get("/")
        policy = page.headers["Content-Security-Policy"]
        assert "frame-ancestors 'none'" in policy and "connect-src 'self'" in policy
        assert "default-src 'none'" in policy and "unsafe-inline" not in policy
        assert page.headers["X-Frame-Options"] == "DENY"
        assert "set-cookie" not in page.headers  # nothing a cross-site request could carry
        lane = (await get_snapshot(client, node.scheduler)).lanes[-1].lane_id
        # What a form on another site can send: no Authorization header.
        forged = await client.post(
            f"/v1/lanes/{lane}/drain",
            content=b"x=1",
            headers={
                "Content-Type": "application/x-www-form-urlencoded",
                "Origin": "https://evil.example",
            },
        )
        assert forged.status_code == 401
        assert not await _drained(client, node.scheduler, lane)


async def test_whoami_names_the_role_of_the_secret(tmp_path: pathlib.Path) -> None:
    async with serving(tmp_path) as (node, client):
        for secret, role in ((node.scheduler, "scheduler"), (node.admin, "admin")):
            reply = await client.get("/v1/whoami", headers=bearer(secret))
            assert reply.status_code == 200 and reply.json() == {"role": role}
        assert (await client.get("/v1/whoami")).status_code == 401


async def test_invocation_detail_follows_its_logs_live_beyond_the_status_tail(
    tmp_path: pathlib.Path,
) -> None:
    browser = chromium()
    script = "echo BEGIN >&2; head -c 9000 /dev/zero | tr '\\0' x >&2; echo END >&2; sleep 60"
    body = {
        "id": "chatty",
        "work": {"kind": "process", "argv": ["sh", "-c", script], "cwd": str(guest_cwd())},
        "resources": {"cpu_millis": 100, "memory_bytes": 2**26},
    }
    async with (
        serving(tmp_path) as (node, client),
        cdp.page(browser, tmp_path / "profile") as tab,
    ):
        accepted = await client.post("/v1/invocations", json=body, headers=bearer(node.scheduler))
        assert accepted.status_code == 202, accepted.text
        await tab.goto(f"{node.url}/#token={node.scheduler}&inv=chatty")
        stderr = "document.querySelector('#stderr').textContent"
        note = "document.querySelector('#stderr-bytes').textContent"
        # The status's tail may show first; then the log route's bytes replace it.
        await tab.wait_for(f"{note}.startsWith('(live') && {stderr}.includes('END')")
        # All of it, not the status's 4,096-character tail, and still open.
        assert (await tab.evaluate(stderr)).startswith("BEGIN\n")
        assert (await tab.evaluate(note)).startswith("(live, 9010 bytes")
        cancelled = await client.delete("/v1/invocations/chatty", headers=bearer(node.scheduler))
        assert cancelled.status_code == 200
        await tab.wait_for(f"{note}.startsWith('(complete')")


LOADED_GPU = "GPU-5e1d0a3c-0000-4000-8000-00000000000c"
LOADED = f"""
[cpu]
logical_cores = 4
[memory]
total = "8GiB"
[[gpus]]
uuid = "{LOADED_GPU}"
name = "SimGPU"
memory = "8GiB"
temperature_c = 40.0
power_w = 50.0
[[faults]]
at = 2.0
gpu = "{LOADED_GPU}"
kind = "load"
utilization_gpu = 80.0
memory_used = "6GiB"
power_w = 200.0
"""


async def test_utilization_memory_and_power_graphs_follow_the_probes(
    tmp_path: pathlib.Path,
) -> None:
    browser = chromium()
    sim = tmp_path / "sim.toml"
    sim.write_text(LOADED)
    async with serving(tmp_path, "--sim-file", str(sim), "--health-interval", "0.05") as (
        node,
        client,
    ):
        # The load starts 2 s in: on two busy cores the daemon's first probe can come
        # later than 0.5 s after its start, and then no sample shows the node unloaded.
        with trio.fail_after(15):  # samples from before the load and after it
            while True:
                reply = await client.get("/v1/devices/history", headers=bearer(node.scheduler))
                (series,) = reply.json()["devices"]
                samples = series["samples"]
                if [s["utilization_gpu_percent"] for s in samples[-2:]] == [80.0, 80.0]:
                    break
                await trio.sleep(0.05)
        assert samples[0]["utilization_gpu_percent"] == 0.0
        assert (
            samples[0]["memory_used_bytes"] == 0 and samples[-1]["memory_used_bytes"] == 6 * 2**30
        )
        dom = await dump_dom(browser, tmp_path / "profile", f"{node.url}/#token={node.scheduler}")
    device = row(dom, "devices", LOADED_GPU)
    assert re.search(r'aria-label="utilization over the last \d+ samples: 0 % to 80 %"', device)
    assert re.search(r'aria-label="power over the last \d+ samples: 50 W to 200 W"', device)
    assert "6.0 GiB / 8.0 GiB" in device and ">80 %<" in device and ">200 W<" in device


async def test_an_admin_drains_and_resumes_the_whole_node_from_the_page(
    tmp_path: pathlib.Path,
) -> None:
    browser = chromium()
    async with (
        serving(tmp_path) as (node, client),
        cdp.page(browser, tmp_path / "profile") as tab,
    ):
        await _sign_in(tab, node.url, node.admin)
        button = "document.querySelector('#node-action')"
        banner = "document.querySelector('#node-banner')"
        await tab.wait_for(f"{button}.dataset.action === 'drain' && !{button}.closest('[hidden]')")
        assert await tab.evaluate(f"{banner}.hidden")
        await tab.evaluate(f"{button}.click(); true")
        await tab.wait_for(f"!{banner}.hidden && {button}.dataset.action === 'resume'")
        assert (await get_snapshot(client, node.scheduler)).drained
        refused = await client.post(
            "/v1/invocations", json=builtin_request("while-drained"), headers=bearer(node.admin)
        )
        assert refused.status_code == 503
        await tab.evaluate(f"{button}.click(); true")
        await tab.wait_for(f"{banner}.hidden && {button}.dataset.action === 'drain'")
        assert not (await get_snapshot(client, node.scheduler)).drained


async def test_a_scheduler_sees_a_drained_node_but_no_node_button(tmp_path: pathlib.Path) -> None:
    browser = chromium()
    async with serving(tmp_path) as (node, client):
        assert (await client.post("/v1/node/drain", headers=bearer(node.admin))).status_code == 200
        dom = await dump_dom(browser, tmp_path / "profile", f"{node.url}/#token={node.scheduler}")
        refused = await client.post("/v1/node/resume", headers=bearer(node.scheduler))
        assert refused.status_code == 403
        assert (await get_snapshot(client, node.scheduler)).drained
    assert re.search(r'<div id="node-banner" class="banner drained" role="alert">', dom)
    assert re.search(r'<div id="node-admin" hidden', dom)
