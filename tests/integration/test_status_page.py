"""The status page in headless Chromium against a real daemon on loopback.

Chromium is not installed by the test. Without it the test is skipped on a
workstation and fails under CI (the CI script installs the `chromium` package).

One Chromium serves the whole module, a new tab for each page load: the page keeps
its secret in the tab's session storage and sets no cookie, so a new tab opens it
as a fresh profile would. One daemon serves the tests that leave it as they found
it (`shared`: they only read, or undo what they change, and their invocations have
ids of their own); a test that needs a node of its own (another configuration, a
list of exactly its invocations, every lane free) starts one.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import struct
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import trio

from supervisor.wire import InvocationState
from tests import cdp
from tests.api_fixtures import (
    RunningDaemon,
    bearer,
    builtin_request,
    get_snapshot,
    running_daemon,
    wait_for_state,
)
from tests.helpers import guest_cwd
from tests.page_fixtures import Chromiums, daemon_in_a_thread

# Under `--dist loadgroup` one worker runs the module: Chromium and the shared daemon
# start once. (With pytest 9.2 and pytest-xdist 3.8 the mark does nothing, see
# pytest-xdist#1386: each worker that runs some of the module starts its own.)
pytestmark = pytest.mark.xdist_group("status_page")


@pytest.fixture(scope="module")
def chromiums(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromiums]:
    held = Chromiums(tmp_path_factory.mktemp("chromium"))
    try:
        yield held
    finally:
        held.close()


@pytest.fixture
def browser(chromiums: Chromiums) -> cdp.Browser:
    """The module's Chromium (started again if a test before crashed it)."""
    return chromiums.get()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """A daemon as `running_daemon` starts it, for the tests that leave it as they found it."""
    with daemon_in_a_thread(tmp_path_factory.mktemp("shared-node")) as node:
        yield node


@contextlib.asynccontextmanager
async def client_of(node: RunningDaemon) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=node.url, timeout=5) as client:
        yield client


@contextlib.asynccontextmanager
async def serving(
    tmp_path: pathlib.Path, *argv: str
) -> AsyncIterator[tuple[RunningDaemon, httpx.AsyncClient]]:
    """A daemon of the test's own on loopback and an HTTP client for it."""
    async with running_daemon(tmp_path, *argv) as node, client_of(node) as client:
        yield node, client


# The page drew a snapshot: it fetched the snapshot, the history and the list of
# invocations together, then drew them all at once.
SNAPSHOT_SHOWN = "document.querySelector('#seq').textContent !== '\N{EN DASH}'"
LOGIN_SHOWN = "!document.querySelector('#login').hidden"


async def dump_dom(browser: cdp.Browser, url: str, shown: str = SNAPSHOT_SHOWN) -> str:
    """The page's markup, opened at `url` in a new tab, once `shown` holds."""
    async with browser.tab() as tab:
        await tab.goto(url)
        await tab.wait_for(shown)
        return await tab.html()


def table_body(dom: str, table_id: str) -> str:
    match = re.search(rf'<table id="{table_id}">.*?<tbody>(.*?)</tbody>', dom, re.DOTALL)
    assert match is not None, f"no #{table_id} table in the page"
    return match.group(1)


async def test_status_page_shows_devices_lanes_and_invocations(
    tmp_path: pathlib.Path, browser: cdp.Browser
) -> None:
    async with serving(tmp_path) as (node, client):
        snapshot = await get_snapshot(client, node.scheduler)
        page = f"{node.url}/#token={node.scheduler}"
        dom = await dump_dom(browser, page)
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
            assert f"VRAM on <code>{vram.lane_id}</code>" in capacity
        assert table_body(dom, "invocations").strip() == ""

        body = builtin_request("from-the-page-test", args={"seconds": 60})
        accepted = await client.post("/v1/invocations", json=body, headers=bearer(node.admin))
        assert accepted.status_code == 202
        running = frozenset({InvocationState.running})
        await wait_for_state(client, node.scheduler, "from-the-page-test", running)
        dom = await dump_dom(browser, page)
        invocations = table_body(dom, "invocations")
        assert "from-the-page-test" in invocations
        assert re.search(r"(queued|running)</td>", invocations)
        # What it runs, how long it has, on which lane.
        assert "<code>builtin:sleep</code>" in invocations
        assert re.search(r"<td>\d+\.\d\d s</td>", invocations), invocations
        assert re.search(r"<td>cpu lane_[0-9a-f]{16}</td>", invocations), invocations


async def test_status_page_asks_for_a_token_when_the_one_given_is_wrong(
    shared: RunningDaemon, browser: cdp.Browser
) -> None:
    node = shared
    refused = "document.querySelector('#status').textContent.includes('not connected')"
    dom = await dump_dom(browser, f"{node.url}/#token=wrong", f"{LOGIN_SHOWN} && {refused}")
    assert re.search(r'<form id="login">', dom), "the login form should be shown"
    assert "not connected" in dom
    assert table_body(dom, "devices").strip() == ""


def row(dom: str, table_id: str, key: str) -> str:
    """The <tr> of `table_id` whose data attribute or text holds `key`."""
    for match in re.finditer(r"<tr[^>]*>.*?</tr>", table_body(dom, table_id), re.DOTALL):
        if key in match.group(0):
            return match.group(0)
    raise AssertionError(f"no row with {key!r} in #{table_id}")


async def test_devices_show_their_readings_and_a_history_at_once(
    tmp_path: pathlib.Path, browser: cdp.Browser
) -> None:
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
        dom = await dump_dom(browser, f"{node.url}/#token={node.scheduler}")
    first = row(dom, "devices", "GPU-5e1d0a3c-0000-4000-8000-5157a0000001")
    assert "41 °C" in first and "72 W" in first  # the simulated workstation's readings
    assert re.search(r"\d+ MiB / 24\.0 GiB|[\d.]+ GiB / 24\.0 GiB", first), first
    # The graphs are drawn from the server's ring, with no wait for new samples.
    label = re.search(r'aria-label="temperature over the last (\d+) samples', first)
    assert label is not None and int(label.group(1)) >= 3, first
    assert "<polyline" in first


async def test_history_needs_an_operator(shared: RunningDaemon) -> None:
    async with client_of(shared) as client:
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


async def test_drained_and_unhealthy_lanes_never_look_free(
    tmp_path: pathlib.Path, browser: cdp.Browser
) -> None:
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
        dom = await dump_dom(browser, f"{node.url}/#token={node.scheduler}")
    lane = row(dom, "lanes", drained.lane_id)
    assert 'class="badge drained">DRAINED — takes no work' in lane, lane
    assert 'class="bar out drained"' in lane
    lane = row(dom, "lanes", sick[0].lane_id)
    assert 'class="badge unhealthy">UNHEALTHY — takes no work' in lane, lane
    vram = row(dom, "capacity", f'data-lane="{drained.lane_id}"')
    assert 'class="bar out drained"' in vram and "DRAINED" in vram, vram
    vram = row(dom, "capacity", f'data-lane="{sick[0].lane_id}"')
    assert 'class="bar out unhealthy"' in vram and "UNHEALTHY" in vram, vram
    cpu = row(dom, "lanes", ">cpu<")
    assert 'class="badge free">free' in cpu, cpu


async def test_the_page_says_when_devices_are_simulated(
    tmp_path: pathlib.Path, shared: RunningDaemon, browser: cdp.Browser
) -> None:
    node = shared  # --devices sim, as running_daemon starts it
    dom = await dump_dom(browser, f"{node.url}/#token={node.scheduler}")
    assert re.search(r'<div id="sim-banner" class="banner" role="alert">', dom), "no banner"
    assert "Simulated devices." in dom and "--devices sim" in dom
    async with running_daemon(tmp_path / "none", devices="none") as node:
        dom = await dump_dom(browser, f"{node.url}/#token={node.scheduler}")
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
    tmp_path: pathlib.Path, browser: cdp.Browser
) -> None:
    async with running_daemon(
        tmp_path, devices="auto", dev=True, pynvml_module=_BrokenNvml()
    ) as node:
        dom = await dump_dom(browser, f"{node.url}/#token={node.scheduler}")
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
    shared: RunningDaemon, browser: cdp.Browser
) -> None:
    node = shared
    async with client_of(node) as client:
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
        # Its fields, and its logs (the status's tails, or the log route's whole streams).
        shown = (
            "!document.querySelector('#detail').hidden"
            " && document.querySelector('#detail-id').textContent === 'oom-job'"
            " && document.querySelector('#stderr').textContent.includes('CUDA out of memory')"
            " && document.querySelector('#stdout').textContent.includes('step 1')"
        )
        dom = await dump_dom(browser, page, shown)
    detail = re.search(r'<section id="detail"[^>]*>(.*?)</section>', dom, re.DOTALL)
    assert detail is not None and " hidden" not in detail.group(0).split(">")[0], "no detail"
    text = detail.group(1)
    assert 'data-field="exit_code">3<' in text, text
    assert re.search(r'data-field="command"><code>sh -c "echo step 1; ', text), text
    assert re.search(r'data-field="duration">\d+\.\d\d s<', text), text
    assert 'data-field="resources">0.1 cores · 64 MiB · 0 GPUs · 0 MiB VRAM<' in text, text
    assert re.search(r'data-field="lanes">cpu lane_[0-9a-f]{16}<', text), text
    assert 'data-field="reason">nonzero_exit<' in text
    sup = node.daemon.supervisor
    measured = sup is not None and sup.guests.cgroups is not None  # usage is the cgroup's
    cpu = r'data-field="cpu">\d+\.\d\d s<' if measured else 'data-field="cpu">\u2013<'
    assert re.search(cpu, text), text
    assert "RuntimeError: CUDA out of memory" in re.sub(r"\s+", " ", text)
    assert "step 1" in text
    assert re.search(r"<td>3</td>", row(dom, "invocations", "oom-job"))  # the exit column


async def _drained(client: httpx.AsyncClient, secret: str, lane_id: str) -> bool:
    snapshot = await get_snapshot(client, secret)
    return next(lane.drained for lane in snapshot.lanes if lane.lane_id == lane_id)


@contextlib.asynccontextmanager
async def undrained(client: httpx.AsyncClient, node: RunningDaemon) -> AsyncIterator[None]:
    """On the way out, however the test ended, resume the shared node and all its lanes
    (the test drains one of them, or the node, or checks that a refusal drained nothing)."""
    try:
        yield
    finally:
        with trio.move_on_after(10, shield=True):
            admin = bearer(node.admin)
            resumed = await client.post("/v1/node/resume", headers=admin)
            assert resumed.status_code == 200, resumed.text
            for lane in (await get_snapshot(client, node.scheduler)).lanes:
                resumed = await client.post(f"/v1/lanes/{lane.lane_id}/resume", headers=admin)
                assert resumed.status_code == 200, resumed.text


@contextlib.asynccontextmanager
async def cancelling(
    client: httpx.AsyncClient, node: RunningDaemon, invocation_id: str
) -> AsyncIterator[None]:
    """On the way out, however the test ended, cancel its invocation on the shared node
    (if it has not ended already), and wait until it has."""
    try:
        yield
    finally:
        with trio.move_on_after(10, shield=True):
            path = f"/v1/invocations/{invocation_id}"
            if (await client.delete(path, headers=bearer(node.scheduler))).status_code != 404:
                await _ended(client, node.scheduler, invocation_id)


async def no_work_left(client: httpx.AsyncClient, node: RunningDaemon) -> None:
    """Wait until no invocation (another test's) is queued or running on the node."""
    live = {"state": ["queued", "running"]}
    with trio.fail_after(20):
        while True:
            reply = await client.get("/v1/invocations", params=live, headers=bearer(node.admin))
            assert reply.status_code == 200, reply.text
            if not reply.json()["invocations"]:
                return
            await trio.sleep(0.05)


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
    shared: RunningDaemon, browser: cdp.Browser
) -> None:
    node = shared
    async with client_of(node) as client, browser.tab() as tab, undrained(client, node):
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


async def test_a_scheduler_gets_no_drain_button_and_is_refused(
    shared: RunningDaemon, browser: cdp.Browser
) -> None:
    node = shared
    async with client_of(node) as client, undrained(client, node):
        dom = await dump_dom(browser, f"{node.url}/#token={node.scheduler}")
        assert "signed in as scheduler" in dom
        assert "lane-action" not in table_body(dom, "lanes")
        lane = (await get_snapshot(client, node.scheduler)).lanes[-1].lane_id
        reply = await client.post(f"/v1/lanes/{lane}/drain", headers=bearer(node.scheduler))
        assert reply.status_code == 403, reply.text
        assert not await _drained(client, node.scheduler, lane)


async def test_an_admin_secret_in_the_address_is_refused(
    shared: RunningDaemon, browser: cdp.Browser
) -> None:
    node = shared
    refused = f"{LOGIN_SHOWN} && document.querySelector('#login-note').textContent.includes('URL')"
    dom = await dump_dom(browser, f"{node.url}/#token={node.admin}", refused)
    assert re.search(r'<form id="login">', dom), "the login form should be shown"
    assert "an admin secret in a URL is refused" in dom
    assert "lane-action" not in table_body(dom, "lanes")
    assert node.admin not in dom


async def test_the_page_cannot_be_framed_or_reach_elsewhere_and_a_cross_site_post_drains_nothing(
    shared: RunningDaemon,
) -> None:
    node = shared
    async with client_of(node) as client, undrained(client, node):
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


async def test_whoami_names_the_role_of_the_secret(shared: RunningDaemon) -> None:
    node = shared
    async with client_of(node) as client:
        for secret, role in ((node.scheduler, "scheduler"), (node.admin, "admin")):
            reply = await client.get("/v1/whoami", headers=bearer(secret))
            assert reply.status_code == 200 and reply.json() == {"role": role}
        assert (await client.get("/v1/whoami")).status_code == 401


async def test_invocation_detail_follows_its_logs_live_beyond_the_status_tail(
    shared: RunningDaemon, browser: cdp.Browser
) -> None:
    node = shared
    script = "echo BEGIN >&2; head -c 9000 /dev/zero | tr '\\0' x >&2; echo END >&2; sleep 60"
    body = {
        "id": "chatty",
        "work": {"kind": "process", "argv": ["sh", "-c", script], "cwd": str(guest_cwd())},
        "resources": {"cpu_millis": 100, "memory_bytes": 2**26},
    }
    async with client_of(node) as client, browser.tab() as tab, cancelling(client, node, "chatty"):
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
    tmp_path: pathlib.Path, browser: cdp.Browser
) -> None:
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
        dom = await dump_dom(browser, f"{node.url}/#token={node.scheduler}")
    device = row(dom, "devices", LOADED_GPU)
    assert re.search(r'aria-label="utilization over the last \d+ samples: 0 % to 80 %"', device)
    assert re.search(r'aria-label="power over the last \d+ samples: 50 W to 200 W"', device)
    assert "6.0 GiB / 8.0 GiB" in device and ">80 %<" in device and ">200 W<" in device


async def test_an_admin_drains_and_resumes_the_whole_node_from_the_page(
    shared: RunningDaemon, browser: cdp.Browser
) -> None:
    node = shared
    async with client_of(node) as client, browser.tab() as tab, undrained(client, node):
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


async def test_a_scheduler_sees_a_drained_node_but_no_node_button(
    shared: RunningDaemon, browser: cdp.Browser
) -> None:
    node = shared
    async with client_of(node) as client, undrained(client, node):
        assert (await client.post("/v1/node/drain", headers=bearer(node.admin))).status_code == 200
        dom = await dump_dom(browser, f"{node.url}/#token={node.scheduler}")
        refused = await client.post("/v1/node/resume", headers=bearer(node.scheduler))
        assert refused.status_code == 403
        assert (await get_snapshot(client, node.scheduler)).drained
    assert re.search(r'<div id="node-banner" class="banner drained" role="alert">', dom)
    assert re.search(r'<div id="node-admin" hidden', dom)


# What the page looks like in a browser window: each test below drives the page as a
# person would (a 1280x800 window, mouse and keys), checks what it shows, and saves a
# screenshot of that moment ($LITEGRAPH_SCREENSHOTS keeps them; else the test's tmp).
VIEWPORT = (1280, 800)
PNG = b"\x89PNG\r\n\x1a\n"
ROW_IDS = "[...document.querySelectorAll('#invocations tbody tr')].map((r) => r.dataset.id)"
RAW_NAME = re.compile(r"\b[a-z]+_(?:millis|bytes)\b")
DASH = "\N{EN DASH}"  # what the page shows for "none" and between the ends of a range


def screenshots(tmp_path: pathlib.Path) -> pathlib.Path:
    where = os.environ.get("LITEGRAPH_SCREENSHOTS")
    return pathlib.Path(where) if where else tmp_path / "screenshots"


async def shoot(tab: cdp.Page, tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    """Save what the tab shows; check it is a PNG of the whole window, not a blank one."""
    path = await tab.screenshot(screenshots(tmp_path) / f"{name}.png")
    data = path.read_bytes()
    assert data.startswith(PNG), f"{path} is not a PNG"
    assert struct.unpack(">II", data[16:24]) == VIEWPORT, path
    assert len(data) > 10_000, f"{path} looks blank ({len(data)} bytes)"
    return path


async def open_page(tab: cdp.Page, node: RunningDaemon, fragment: str = "") -> None:
    """The page in a 1280x800 window, signed in as the scheduler, once it shows the node."""
    await tab.viewport(*VIEWPORT)
    await tab.goto(f"{node.url}/#token={node.scheduler}{fragment}")
    await tab.wait_for(
        "document.querySelector('#role').textContent.startsWith('signed in')"
        " && document.querySelectorAll('#lanes tbody tr').length > 0"
    )


def js(value: Any) -> str:
    """`value` as a JavaScript literal (JSON, compact: as JSON.stringify writes it)."""
    return json.dumps(value, separators=(",", ":"))


async def choose(tab: cdp.Page, select: str, value: str) -> None:
    """Pick `value` in the <select> `select`, as a person does (a change event follows)."""
    await tab.evaluate(
        f"(() => {{ const s = document.querySelector({js(select)}); s.value = {js(value)};"
        " s.dispatchEvent(new Event('change', { bubbles: true })); return true; })()"
    )


async def rows_are(tab: cdp.Page, ids: list[str]) -> None:
    await tab.wait_for(f"JSON.stringify({ROW_IDS}) === {js(js(ids))}")


async def submit(client: httpx.AsyncClient, secret: str, body: dict[str, Any]) -> None:
    reply = await client.post("/v1/invocations", json=body, headers=bearer(secret))
    assert reply.status_code == 202, reply.text


def fmt_bytes(n: int) -> str:
    """What the page writes for `n` bytes."""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.0f} MiB"


def fmt_cores(millis: int) -> str:
    return f"{millis / 1000:.1f} core" + ("" if millis == 1000 else "s")


def echo(invocation_id: str) -> dict[str, Any]:
    return builtin_request(invocation_id, name="echo", args={"text": invocation_id})


async def test_a_clicked_invocation_opens_its_detail_in_view_beside_the_list(
    tmp_path: pathlib.Path, browser: cdp.Browser
) -> None:
    ids = [f"echo-{k:02}" for k in range(12)]
    async with serving(tmp_path) as (node, client), browser.tab() as tab:
        for invocation_id in ids:
            await submit(client, node.scheduler, echo(invocation_id))
        for invocation_id in ids:  # all ended: no row (nor lane) redrawn under the mouse
            await _ended(client, node.scheduler, invocation_id)
        await open_page(tab, node)
        await tab.wait_for(f"{ROW_IDS}.length === {len(ids)}")
        chosen = ids[-1]  # the newest: the first row, with the whole list below it
        await click_in_row(tab, chosen, "a.inv")  # its link, as the page has always had
        await detail_shows(tab, chosen)
        cell = f"document.querySelector('tr[data-id=\"{chosen}\"] td.command')"
        seen = await tab.evaluate(
            "(() => { const d = document.querySelector('#detail').getBoundingClientRect();"
            " const f = document.querySelector('#detail-fields').getBoundingClientRect();"
            f" const c = {cell}.getBoundingClientRect();"
            " const hit = document.elementFromPoint(c.x + c.width / 2, c.y + c.height / 2);"
            " return { top: d.top, bottom: d.bottom, left: d.left, right: d.right, fields: f.top,"
            " height: innerHeight, width: innerWidth, focus: document.activeElement.id,"
            " row: hit?.closest('tr')?.dataset.id ?? null, rowTop: c.top, rowBottom: c.bottom,"
            f" selected: {cell}.closest('tr').classList.contains('selected') }}; }})()"
        )
        # The detail is where the user is looking: its top at the window's top, all of it
        # inside the window, its fields showing; the row clicked is still in sight, not
        # covered by the detail, and marked.
        assert 0 <= seen["top"] <= seen["height"] / 4, seen
        assert seen["bottom"] <= seen["height"] and 0 <= seen["left"] < seen["right"], seen
        assert seen["right"] <= seen["width"] and seen["fields"] < seen["height"] / 2, seen
        assert 0 <= seen["rowTop"] and seen["rowBottom"] <= seen["height"], seen
        assert seen["row"] == chosen and seen["selected"], seen
        assert seen["focus"] == "detail", seen  # a keyboard or screen-reader user is taken there
        await shoot(tab, tmp_path, "detail-beside-the-list")
        await tab.press("Escape", 27)
        await tab.wait_for("document.querySelector('#detail').hidden")
        # The focus goes back to the invocation's link in the list.
        assert await tab.evaluate("document.activeElement.closest('tr')?.dataset.id") == chosen
        # Anywhere on a row opens it too: here its command, not its link.
        await click_in_row(tab, ids[0], "td.command")
        await detail_shows(tab, ids[0])


async def click_in_row(tab: cdp.Page, invocation_id: str, part: str) -> None:
    """Scroll the row to the window's top and click the middle of its `part`, with the mouse.

    The page may move between measuring the row and the click (a table above it drawn
    anew under load): the row the mouse landed on is recorded, and a click that landed
    on another is aimed again, so what is tested is what a click on this row does."""
    target = f"document.querySelector('tr[data-id={js(invocation_id)}] {part}')"
    hit = None
    for _ in range(3):
        x, y = await tab.evaluate(
            f"(() => {{ {target}.closest('tr').scrollIntoView({{ block: 'start' }});"
            " window.lgClickedRow = null;"
            " document.addEventListener('mousedown', (e) => { window.lgClickedRow ="
            " e.target.closest('tr')?.dataset.id ?? ''; }, { capture: true, once: true });"
            f" const r = {target}.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        await tab.click(x, y)
        hit = await tab.evaluate("window.lgClickedRow")
        if hit == invocation_id:
            return
    raise AssertionError(f"every click meant for {invocation_id} landed on {hit!r}")


async def detail_shows(tab: cdp.Page, invocation_id: str) -> None:
    await tab.wait_for(
        "!document.querySelector('#detail').hidden"
        f" && document.querySelector('#detail-id').textContent === {js(invocation_id)}"
        " && document.querySelector('[data-field=exit_code]')?.textContent === '0'"
    )


async def test_the_invocation_list_pages_and_filters_by_state_with_end_times(
    tmp_path: pathlib.Path, browser: cdp.Browser
) -> None:
    async with serving(tmp_path) as (node, client), browser.tab() as tab:
        for k in range(12):
            await submit(client, node.scheduler, echo(f"echo-{k:02}"))
        await submit(
            client, node.scheduler, builtin_request("broken", name="fail", labels={"team": "ml"})
        )
        await submit(client, node.scheduler, builtin_request("sleeper", args={"seconds": 60}))
        await _ended(client, node.scheduler, "echo-11")
        broken = await _ended(client, node.scheduler, "broken")
        assert broken["state"] == "failed", broken
        listed = await client.get("/v1/invocations", headers=bearer(node.scheduler))
        newest_first = [inv["id"] for inv in listed.json()["invocations"]]
        assert len(newest_first) == 14
        await open_page(tab, node)
        await rows_are(tab, newest_first)  # 25 a page: all of them, and no pager
        assert await tab.evaluate("document.querySelector('#inv-pages').hidden")

        # Ten a page: the first ten, and a way to the others.
        await choose(tab, "#inv-limit", "10")
        await rows_are(tab, newest_first[:10])
        pager = "document.querySelector('#inv-pages')"
        await tab.wait_for(f"!{pager}.hidden && !document.querySelector('#inv-next').disabled")
        await tab.evaluate("document.querySelector('#inv-next').click(); true")
        await rows_are(tab, newest_first[10:])
        assert await tab.evaluate("document.querySelector('#inv-next').disabled")
        assert await tab.evaluate("document.querySelector('#inv-page').textContent") == (
            f"page 2 · 11{DASH}14"
        )
        await tab.evaluate(f"{pager}.scrollIntoView({{ block: 'end' }}); true")
        await shoot(tab, tmp_path, "list-page-2")
        await tab.evaluate("document.querySelector('#inv-prev').click(); true")
        await rows_are(tab, newest_first[:10])

        # The state filter narrows the list (through the node's ?state=).
        await choose(tab, "#inv-state", "failed")
        await rows_are(tab, ["broken"])
        await tab.wait_for(f"{pager}.hidden")
        await tab.evaluate("document.querySelector('#invocations').scrollIntoView(); true")
        await shoot(tab, tmp_path, "list-filtered-failed")
        await choose(tab, "#inv-state", "running")
        await rows_are(tab, ["sleeper"])
        await choose(tab, "#inv-state", "succeeded")
        await rows_are(tab, [i for i in newest_first if i.startswith("echo-")][:10])
        await choose(tab, "#inv-state", "")
        await rows_are(tab, newest_first[:10])
        # And by label (the node's ?label=); one it refuses is said, not guessed at.
        label = "document.querySelector('#inv-label')"
        change = "dispatchEvent(new Event('change', { bubbles: true }))"
        await tab.evaluate(f"{label}.value = 'team=ml'; {label}.{change}; true")
        await rows_are(tab, ["broken"])
        await tab.evaluate(f"{label}.value = 'no equals sign'; {label}.{change}; true")
        await tab.wait_for("document.querySelector('#inv-note').textContent.includes('label')")
        await tab.evaluate(f"{label}.value = ''; {label}.{change}; true")
        await rows_are(tab, newest_first[:10])
        assert await tab.evaluate("document.querySelector('#inv-note').textContent") == ""

        # Each row says when it ended (its ended_at, in local time), or a dash while it runs.
        ended = await tab.evaluate(
            "Object.fromEntries([...document.querySelectorAll('#invocations tbody tr')].map((r) =>"
            " [r.dataset.id, r.querySelector('td.ended time')?.getAttribute('datetime')"
            " ?? r.querySelector('td.ended').textContent]))"
        )
    assert ended["sleeper"] == DASH, ended
    assert ended["broken"] == broken["ended_at"], ended
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT.*Z", ended[i]) for i in newest_first[2:10]), ended


async def test_the_devices_table_lists_mig_instances_under_their_gpu(
    tmp_path: pathlib.Path, shared: RunningDaemon, browser: cdp.Browser
) -> None:
    node = shared
    async with client_of(node) as client, browser.tab() as tab:
        reply = await client.get("/v1/snapshot", headers=bearer(node.scheduler))
        devices = reply.json()["devices"]
        await open_page(tab, node)
        rows = await tab.evaluate(
            "[...document.querySelectorAll('#devices tbody tr')].map((r) => ({"
            " id: r.dataset.device, parent: r.dataset.parent ?? null, text: r.innerText,"
            " indent: r.querySelector('code').getBoundingClientRect().left }))"
        )
        await shoot(tab, tmp_path, "devices-with-mig-instances")
        lanes = await tab.evaluate(
            "Object.fromEntries([...document.querySelectorAll('#lanes tbody tr')].map((r) =>"
            " [r.dataset.lane, r.children[2].innerText]))"
        )
    expected = [
        (m["mig_uuid"] if m else d["device_id"], d["device_id"] if m else None)
        for d in devices
        for m in (None, *d["mig_instances"])
    ]
    assert [(r["id"], r["parent"]) for r in rows] == expected, rows
    migs = [m for d in devices for m in d["mig_instances"]]
    assert len(migs) >= 2, "the simulated workstation has a GPU split into MIG instances"
    by_id = {r["id"]: r for r in rows}
    for d in (d for d in devices if d["mig_instances"]):
        parent = by_id[d["device_id"]]
        assert f"MIG: {len(d['mig_instances'])} instances" in parent["text"], parent
        for m in d["mig_instances"]:
            shown = by_id[m["mig_uuid"]]
            assert f"MIG {m['profile']}" in shown["text"], shown
            used = f"{fmt_bytes(m['memory_used_bytes'])} / {fmt_bytes(m['memory_total_bytes'])}"
            assert used in shown["text"], shown
            assert shown["indent"] > parent["indent"], (shown, parent)  # drawn under it
    # A MIG lane names its instance and the GPU it is on.
    mig_lanes = [text for text in lanes.values() if text.startswith("MIG-")]
    assert len(mig_lanes) == len(migs), lanes
    assert all("\non GPU-" in text for text in mig_lanes), lanes


async def test_a_lane_an_invocation_holds_shows_busy_and_the_others_free(
    tmp_path: pathlib.Path, shared: RunningDaemon, browser: cdp.Browser
) -> None:
    node = shared
    body = builtin_request(
        "holder",
        args={"seconds": 60},
        requirement="gpu",
        resources={"cpu_millis": 100, "memory_bytes": 2**20, "gpus": 1, "vram_bytes": 2**30},
    )
    async with (
        client_of(node) as client,
        browser.tab() as tab,
        undrained(client, node),
        cancelling(client, node, "holder"),
    ):
        await no_work_left(client, node)  # every lane free, as on a node of its own
        await submit(client, node.scheduler, body)
        with trio.fail_after(10):
            while True:
                reply = await client.get("/v1/invocations/holder", headers=bearer(node.scheduler))
                status = reply.json()
                if status["state"] == "running":
                    break
                await trio.sleep(0.05)
        held = {lane["lane_id"] for lane in status["lanes"]}
        assert held, status
        snapshot = await get_snapshot(client, node.scheduler)
        await open_page(tab, node)
        state = (
            "Object.fromEntries([...document.querySelectorAll('#lanes tbody tr')].map((r) =>"
            " [r.dataset.lane, r.querySelector('.lane-state').innerText]))"
        )
        await tab.wait_for(f"Object.values({state}).some((t) => t.startsWith('busy'))")
        shown = await tab.evaluate(state)
        await tab.evaluate("document.querySelector('#lanes').scrollIntoView(); true")
        await shoot(tab, tmp_path, "lanes-busy-and-free")
        allocated = await tab.evaluate(
            "Object.fromEntries([...document.querySelectorAll('#capacity tbody tr[data-lane]')]"
            ".map((r) => [r.dataset.lane, r.children[4].innerText]))"
        )
        # Once it ends, its lanes are free again (the page follows the node's events).
        cancelled = await client.delete("/v1/invocations/holder", headers=bearer(node.scheduler))
        assert cancelled.status_code == 200
        await tab.wait_for(f"Object.values({state}).every((t) => t === 'free')")
    assert set(shown) == {lane.lane_id for lane in snapshot.lanes}
    for lane_id, text in shown.items():
        if lane_id in held:
            assert text.startswith("busy") and "1 running" in text and "holder" in text, text
        else:
            assert text == "free", (lane_id, text)
    gpu_lanes = [lane["lane_id"] for lane in status["lanes"] if lane["vram_bytes"]]
    assert gpu_lanes, status
    for lane_id in gpu_lanes:
        assert "1.0 GiB VRAM allocated" in shown[lane_id], shown[lane_id]
        assert allocated[lane_id] == "1.0 GiB", allocated


async def test_resources_are_shown_with_human_names_and_units(
    tmp_path: pathlib.Path, browser: cdp.Browser
) -> None:
    body = builtin_request(
        "sized",
        name="echo",
        args={"text": "hi"},
        resources={"cpu_millis": 1000, "memory_bytes": 64 * 2**20},
    )
    async with serving(tmp_path) as (node, client), browser.tab() as tab:
        await submit(client, node.scheduler, body)
        await _ended(client, node.scheduler, "sized")
        capacity = (await client.get("/v1/snapshot", headers=bearer(node.scheduler))).json()[
            "capacity"
        ]
        await open_page(tab, node, "&inv=sized")
        resources = "document.querySelector('[data-field=resources]')?.textContent"
        await tab.wait_for(f"{resources} && {ROW_IDS}.length === 1")
        text = await tab.evaluate("document.body.innerText")
        cells = await tab.evaluate(
            "Object.fromEntries([...document.querySelectorAll('#capacity tbody tr[data-resource]')]"
            ".map((r) => [r.dataset.resource, [...r.children].map((c) => c.innerText)]))"
        )
        bars = await tab.evaluate(
            "Object.fromEntries([...document.querySelectorAll('#capacity tbody tr[data-resource]')]"
            ".map((r) => [r.dataset.resource, r.querySelector('.bar').getAttribute('aria-label')]))"
        )
        detail = await tab.evaluate(resources)
        await tab.evaluate("document.querySelector('#capacity').scrollIntoView(); true")
        await shoot(tab, tmp_path, "human-units")
    assert not RAW_NAME.findall(text), RAW_NAME.findall(text)  # no cpu_millis, memory_bytes
    assert detail == "1.0 core · 64 MiB · 0 GPUs · 0 MiB VRAM", detail
    fields = ("capacity", "reserved", "allocated", "allocatable")
    cpu, memory, gpus = capacity["cpu_millis"], capacity["memory_bytes"], capacity["gpus"]
    assert cells["cpu_millis"] == ["CPU", "", *(fmt_cores(cpu[f]) for f in fields)], cells
    assert cells["memory_bytes"] == ["memory", "", *(fmt_bytes(memory[f]) for f in fields)]
    plural = {n: f"{n} GPU" + ("" if n == 1 else "s") for n in (gpus[f] for f in fields)}
    assert cells["gpus"] == ["GPUs", "", *(plural[gpus[f]] for f in fields)], cells
    assert bars["memory_bytes"] == (
        f"{fmt_bytes(memory['allocated'])} allocated and {fmt_bytes(memory['reserved'])}"
        f" reserved of {fmt_bytes(memory['capacity'])}"
    ), bars
    assert "1.0 core" in cells["cpu_millis"], cells  # the node reserves one core


async def test_sparklines_carry_their_scale_and_the_time_they_span(
    tmp_path: pathlib.Path, browser: cdp.Browser
) -> None:
    sim = tmp_path / "sim.toml"
    sim.write_text(LOADED)
    # A probe each 0.2 s: the page's 120 samples span 24 s, the whole test.
    argv = ("--sim-file", str(sim), "--health-interval", "0.2")
    async with serving(tmp_path, *argv) as (node, client), browser.tab() as tab:
        with trio.fail_after(15):  # samples from before the load (2 s in) and after it
            while True:
                reply = await client.get("/v1/devices/history", headers=bearer(node.scheduler))
                (series,) = reply.json()["devices"]
                power = [s["power_w"] for s in series["samples"]]
                if power[:1] == [50.0] and power[-1:] == [200.0]:
                    break
                await trio.sleep(0.1)
        await open_page(tab, node)
        scales = (
            f"Object.fromEntries([...document.querySelectorAll('tr[data-device={js(LOADED_GPU)}]"
            " .metric')].map((m) => [m.dataset.field, [...m.querySelectorAll('.scale > span,"
            " .window')].map((s) => s.textContent)]))"
        )
        await tab.wait_for(f"({scales}).power_w?.[0] === '200 W'")
        shown = await tab.evaluate(scales)
        visible = await tab.evaluate(
            "[...document.querySelectorAll('#devices .scale')].every((s) =>"
            " s.getBoundingClientRect().width > 0 && getComputedStyle(s).visibility === 'visible')"
        )
        await shoot(tab, tmp_path, "sparkline-scales")
    window = r"last \d+ s"
    # Utilization and memory run from 0 to their ceiling; the others from the lowest
    # reading to the highest (one label where the reading held steady).
    util, memory = shown["utilization_gpu_percent"], shown["memory_used_bytes"]
    assert util[:2] == ["100 %", "0 %"] and re.fullmatch(window, util[2]), shown
    assert memory[:2] == ["8.0 GiB", "0 MiB"] and re.fullmatch(window, memory[2]), shown
    assert shown["power_w"][:2] == ["200 W", "50 W"], shown
    temperature = shown["temperature_c"]
    assert re.fullmatch(r"\d+ °C", temperature[0]) and re.fullmatch(window, temperature[-1])
    assert visible
