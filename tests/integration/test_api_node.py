"""Probes, metrics, snapshot, events and OpenAPI over real HTTP (Hypercorn on port 0)."""

from __future__ import annotations

import contextlib
import pathlib

import httpx
import msgspec
import trio
from prometheus_client.parser import text_string_to_metric_families

from api.errors import ErrorEnvelope
from machine.snapshot import NodeSnapshot
from node.daemon import EVENT_SUBSCRIBERS
from supervisor.wire import InvocationState
from tests.api_fixtures import (
    SSE_CONNECTED,
    bearer,
    builtin_request,
    event_run,
    get_snapshot,
    running_daemon,
    settled_snapshot,
    sse_connect,
    wait_for_state,
)
from tests.fakes.fake_pynvml import FakeNvml, NVMLError_DriverNotLoaded

DESIGN_PATHS = {
    "/healthz": {"get"},
    "/readyz": {"get"},
    "/metrics": {"get"},
    "/v1/snapshot": {"get"},
    "/v1/events": {"get"},
    "/v1/invocations": {"get", "post"},
    "/v1/invocations/{invocation_id}": {"get", "delete"},
    "/v1/lanes/{lane_id}/work": {"post"},
    "/v1/lanes/{lane_id}/drain": {"post"},
    "/v1/lanes/{lane_id}/resume": {"post"},
    "/openapi.json": {"get"},
    "/": {"get"},
}


def error_code(reply: httpx.Response) -> str:
    return msgspec.json.decode(reply.content, type=ErrorEnvelope).error.code


async def test_probes_answer_and_readyz_is_ready_once_started(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        health = await client.get("/healthz")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        ready = await client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["status"] == "ready"


async def test_readyz_is_503_with_reasons_when_demanded_nvml_fails(
    tmp_path: pathlib.Path,
) -> None:
    broken = FakeNvml([], init_error=NVMLError_DriverNotLoaded())
    async with (
        running_daemon(tmp_path, devices="nvml", pynvml_module=broken) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        assert (await client.get("/healthz")).status_code == 200
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        body = msgspec.json.decode(ready.content, type=ErrorEnvelope).error
        assert body.code == "not_ready"
        assert "devices" in body.details["reasons"]
        assert body.details["reasons"]["devices"]  # says why, not just "no"


async def test_metrics_exposition_has_capacity_gauges(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        await settled_snapshot(client, node.scheduler)
        reply = await client.get("/metrics")
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(reply.text)}
        for unit in ("cpu_millis", "memory_bytes", "gpus", "vram_bytes"):
            family = families[f"litegraph_capacity_{unit}"]
            assert family.type == "gauge"
            assert {s.labels["kind"] for s in family.samples} == {
                "total",
                "reserved",
                "allocated",
                "allocatable",
            }
        for name in ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_FB_USED", "litegraph_device_health"):
            assert families[name].samples, name
        assert families["litegraph_invocations_ended"].type == "counter"
        assert families["litegraph_invocations_active"].samples
        assert families["litegraph_build_info"].samples[0].value == 1
        assert families["process_resident_memory_bytes"].samples[0].value > 0


async def test_metrics_lane_work_label_is_the_snake_case_op(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        body = builtin_request("m1", args={"seconds": 30})
        accepted = await client.post("/v1/invocations", json=body, headers=bearer(node.scheduler))
        lane, token = next(iter(accepted.json()["tokens"].items()))
        work = await client.post(
            f"/v1/lanes/{lane}/work",
            json={"op": "execute", "kernel": "noop"},
            headers=bearer(token),
        )
        assert work.status_code == 200, work.text
        text = (await client.get("/metrics")).text
        assert 'litegraph_lane_work_seconds_count{op="execute"} 1.0' in text
        # The host hop inside it, as the lane owner waited for it.
        assert 'litegraph_lane_host_seconds_count{op="run"} 1.0' in text


async def test_metrics_auth_requires_an_operator_credential(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path, "--metrics-auth", "true") as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        anonymous = await client.get("/metrics")
        assert anonymous.status_code == 401 and error_code(anonymous) == "unauthenticated"
        assert "WWW-Authenticate" in anonymous.headers
        wrong = await client.get("/metrics", headers=bearer("x" * 43))
        assert wrong.status_code == 401
        for secret in (node.scheduler, node.admin):
            reply = await client.get("/metrics", headers=bearer(secret))
            assert reply.status_code == 200 and "litegraph_capacity_cpu_millis" in reply.text


async def test_snapshot_decodes_and_sequence_moves_only_on_change(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        first = await settled_snapshot(client, node.scheduler)
        assert isinstance(first, NodeSnapshot) and first.schema_version == 1
        assert first.devices and first.lanes
        # Nothing changed: the same document, the same sequence.
        for _ in range(3):
            again = await get_snapshot(client, node.scheduler)
            assert again.sequence == first.sequence and again == first
        body = builtin_request("s1", args={"seconds": 30})
        accepted = await client.post("/v1/invocations", json=body, headers=bearer(node.scheduler))
        assert accepted.status_code == 202
        await wait_for_state(client, node.scheduler, "s1", frozenset({InvocationState.running}))
        changed = await get_snapshot(client, node.scheduler)
        assert changed.sequence > first.sequence
        assert changed.capacity.cpu_millis.allocatable < first.capacity.cpu_millis.allocatable
        # The snapshot never carries a credential.
        raw = (await client.get("/v1/snapshot", headers=bearer(node.admin))).text
        assert "v4.public." not in raw and node.scheduler not in raw and node.admin not in raw


async def test_events_stream_shows_an_invocation(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
        sse_connect(node.url, node.scheduler) as stream,
    ):
        assert stream.status == 200
        assert "content-type: text/event-stream" in stream.head.lower()
        assert (await stream.next_block()) == SSE_CONNECTED
        body = builtin_request("e1", "echo", {"text": "hello"})
        accepted = await client.post("/v1/invocations", json=body, headers=bearer(node.admin))
        assert accepted.status_code == 202
        states: list[str] = []
        with trio.fail_after(10):
            while not states or states[-1] != "succeeded":
                block = await stream.next_block()
                event = msgspec.json.decode(block["data"])
                assert block["event"] == event["kind"]
                run, _, sequence = block["id"].rpartition("-")
                assert run == event_run(node) and int(sequence) > 0
                if event["kind"] == "invocation" and event["invocation"]["id"] == "e1":
                    states.append(event["invocation"]["state"])
        assert states[0] == "queued" and states[-1] == "succeeded"


async def test_events_subscriber_cap_gives_429_and_closed_streams_free_slots(
    tmp_path: pathlib.Path,
) -> None:
    async with running_daemon(tmp_path) as node:
        async with contextlib.AsyncExitStack() as subscribers:
            for _ in range(EVENT_SUBSCRIBERS):
                stream = await subscribers.enter_async_context(
                    sse_connect(node.url, node.scheduler)
                )
                assert stream.status == 200
                assert (await stream.next_block()) == SSE_CONNECTED
            async with sse_connect(node.url, node.scheduler) as refused:
                assert refused.status == 429
                assert "retry-after: 5" in refused.head.lower()
                envelope = msgspec.json.decode(await refused.body(), type=ErrorEnvelope)
                assert envelope.error.code == "too_many_subscribers"
        # Every subscriber hung up: their slots come free again.
        with trio.fail_after(10):
            while True:
                async with sse_connect(node.url, node.scheduler) as stream:
                    if stream.status == 200:
                        break
                await trio.sleep(0.05)


async def test_openapi_is_3_1_and_lists_every_designed_path(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        reply = await client.get("/openapi.json")
        assert reply.status_code == 200
        document = reply.json()
        assert document["openapi"].startswith("3.1")
        for path, methods in DESIGN_PATHS.items():
            assert path in document["paths"], path
            assert methods <= set(document["paths"][path]), path


async def test_status_page_is_served_on_loopback(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        page = await client.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert "litegraph-node" in page.text


async def test_unknown_path_is_404_in_the_envelope(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        reply = await client.get("/v1/nothing", headers=bearer(node.admin))
        assert reply.status_code == 404 and error_code(reply) == "not_found"
