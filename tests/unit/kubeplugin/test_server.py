"""The kubelet plugin against a fake kubelet (a grpcio client on temporary sockets):
registration, per-claim answers, bounded calls, and GetInfo while a Prepare waits."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import pytest
import trio

from kubeplugin.contracts import (
    dra_health_pb2,
    dra_pb2,
    dra_pb2_grpc,
    registration_pb2,
    registration_pb2_grpc,
)
from kubeplugin.health import HEALTH_SERVICE, DeviceHealthReading
from kubeplugin.server import V1BETA1_SERVICE, ClaimRef, ClaimResult, PreparedDevice
from kubeplugin.sockets import DRIVER_NAME, PluginSockets, SocketError
from tests.kube_fixtures import health_stream, kubelet, plugin

READY = ClaimResult(
    devices=(
        PreparedDevice(
            pool_name="node-a",
            device_name="gpu-0",
            request_names=("gpu",),
            cdi_device_ids=(f"{DRIVER_NAME}/claim=uid-ok",),
        ),
    )
)


class Handler:
    """Prepares `uid-ok`, refuses `uid-bad`, says nothing of others; `delay` stalls."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.prepared: list[list[str]] = []

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, ClaimResult]:
        self.prepared.append([c.uid for c in claims])
        await trio.sleep(self.delay)
        answers = {"uid-ok": READY, "uid-bad": ClaimResult(error="lane_unhealthy: gpu-0")}
        return {c.uid: answers[c.uid] for c in claims if c.uid in answers}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        return {c.uid: "" for c in claims}


class V1beta1Stub:
    """A 1.32 or 1.33 kubelet's client: the same messages, at v1beta1's method paths."""

    def __init__(self, channel: grpc.Channel) -> None:
        for name, answer in (
            ("NodePrepareResources", dra_pb2.NodePrepareResourcesResponse),
            ("NodeUnprepareResources", dra_pb2.NodeUnprepareResourcesResponse),
        ):
            call = channel.unary_unary(
                f"/{V1BETA1_SERVICE}/{name}",
                request_serializer=lambda message: message.SerializeToString(),
                response_deserializer=answer.FromString,
            )
            setattr(self, name, call)


def _claims(*uids: str) -> list[Any]:
    return [dra_pb2.Claim(namespace="ns", uid=uid, name=f"claim-{uid}") for uid in uids]


async def test_kubelet_registers_the_plugin_then_prepares_each_claim_on_its_own() -> None:
    handler = Handler()
    async with plugin(handler) as (sockets, state):
        reg = registration_pb2_grpc.RegistrationStub
        info = await kubelet(sockets.registration, reg, "GetInfo", registration_pb2.InfoRequest())
        assert (info.type, info.name, info.endpoint) == (
            "DRAPlugin", DRIVER_NAME, str(sockets.service),
        )  # fmt: skip
        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        status = registration_pb2.RegistrationStatus(plugin_registered=True)
        await kubelet(sockets.registration, reg, "NotifyRegistrationStatus", status)
        assert (state.registered, state.notified) == (True, 1)
        node = dra_pb2_grpc.DRAPluginStub
        request = dra_pb2.NodePrepareResourcesRequest(claims=_claims("uid-ok", "uid-bad", "uid-x"))
        reply = await kubelet(sockets.service, node, "NodePrepareResources", request)
        ok, bad, unknown = (reply.claims[uid] for uid in ("uid-ok", "uid-bad", "uid-x"))
        assert ok.error == "" and len(ok.devices) == 1
        device = ok.devices[0]
        assert (device.pool_name, device.device_name, list(device.request_names)) == (
            "node-a", "gpu-0", ["gpu"],
        )  # fmt: skip
        assert list(device.cdi_device_ids) == [f"{DRIVER_NAME}/claim=uid-ok"]
        assert not device.HasField("share_id")
        assert bad.error == "lane_unhealthy: gpu-0" and not bad.devices
        assert unknown.error.startswith("no_answer:")
        assert handler.prepared == [["uid-ok", "uid-bad", "uid-x"]]  # one batch
        undo = dra_pb2.NodeUnprepareResourcesRequest(claims=_claims("uid-ok", "uid-never"))
        undone = await kubelet(sockets.service, node, "NodeUnprepareResources", undo)
        assert {uid: e.error for uid, e in undone.claims.items()} == {"uid-ok": "", "uid-never": ""}
        # A 1.33 kubelet calls the service at v1beta1's paths, on the same socket.
        beta = await kubelet(sockets.service, V1beta1Stub, "NodePrepareResources", request)
        assert beta == reply
        undo_beta = dra_pb2.NodeUnprepareResourcesRequest(claims=_claims("uid-ok"))
        undone_beta = await kubelet(
            sockets.service, V1beta1Stub, "NodeUnprepareResources", undo_beta
        )
        assert undone_beta.claims["uid-ok"].error == ""


async def test_a_prepare_past_its_bound_answers_each_claim_and_getinfo_stays_fast() -> None:
    handler = Handler(delay=60)
    async with plugin(handler, call_seconds=1.0) as (sockets, _state):
        async with trio.open_nursery() as nursery:
            replies: list[Any] = []

            async def prepare() -> None:
                request = dra_pb2.NodePrepareResourcesRequest(claims=_claims("uid-ok", "uid-bad"))
                node = dra_pb2_grpc.DRAPluginStub
                replies.append(
                    await kubelet(sockets.service, node, "NodePrepareResources", request)
                )

            nursery.start_soon(prepare)
            while not handler.prepared:  # noqa: ASYNC110 - the Prepare is waiting on trio
                await trio.sleep(0.01)
            started = time.monotonic()
            reg = registration_pb2_grpc.RegistrationStub
            await kubelet(sockets.registration, reg, "GetInfo", registration_pb2.InfoRequest())
            assert time.monotonic() - started < 1.0  # kubelet's liveness poll is not held up
        errors = {uid: entry.error for uid, entry in replies[0].claims.items()}
        assert errors == {
            "uid-ok": "prepare_timeout: no answer in 1 s",
            "uid-bad": "prepare_timeout: no answer in 1 s",
        }


def test_a_driver_name_or_socket_path_kubelet_would_refuse_is_refused() -> None:
    with pytest.raises(SocketError, match="DNS subdomain"):
        PluginSockets.for_driver("Lanes_Litegraph")
    with pytest.raises(SocketError, match="longer than a Unix socket path"):
        PluginSockets.for_driver(DRIVER_NAME, plugins=pathlib.Path("/" + "p" * 100))
    found = PluginSockets.for_driver(DRIVER_NAME)
    assert str(found.registration) == f"/var/lib/kubelet/plugins_registry/{DRIVER_NAME}-reg.sock"
    assert str(found.service) == f"/var/lib/kubelet/plugins/{DRIVER_NAME}/dra.sock"


async def test_the_health_stream_says_every_device_at_once_then_each_change() -> None:
    readings = [DeviceHealthReading("gpu-0", True), DeviceHealthReading("mig-1", True)]
    async with plugin(Handler(), health=lambda: list(readings)) as (sockets, _state):
        reg = registration_pb2_grpc.RegistrationStub
        info = await kubelet(sockets.registration, reg, "GetInfo", registration_pb2.InfoRequest())
        assert list(info.supported_versions) == [
            "v1.DRAPlugin", "v1beta1.DRAPlugin", HEALTH_SERVICE,
        ]  # fmt: skip
        async with health_stream(sockets.service, 2) as received:
            with trio.fail_after(20):
                first = await received.receive()
                readings[1] = DeviceHealthReading("mig-1", False, "lane_faulted: host crashed")
                second = await received.receive()
        assert [(d.device.pool_name, d.device.device_name, d.health) for d in first.devices] == [
            ("node-a", "gpu-0", dra_health_pb2.HEALTHY),
            ("node-a", "mig-1", dra_health_pb2.HEALTHY),
        ]
        flipped = {d.device.device_name: d for d in second.devices}
        assert flipped["mig-1"].health == dra_health_pb2.UNHEALTHY
        assert flipped["mig-1"].message == "lane_faulted: host crashed"
        assert flipped["gpu-0"].health == dra_health_pb2.HEALTHY
        assert flipped["mig-1"].health_check_timeout_seconds > 0


async def test_without_a_health_source_the_stream_is_not_advertised() -> None:
    async with plugin(Handler()) as (sockets, _state):
        reg = registration_pb2_grpc.RegistrationStub
        info = await kubelet(sockets.registration, reg, "GetInfo", registration_pb2.InfoRequest())
        assert HEALTH_SERVICE not in info.supported_versions


async def test_a_deleted_registration_socket_is_served_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("kubeplugin.server.REGISTRATION_CHECK_SECONDS", 0.05)
    async with plugin(Handler()) as (sockets, _state):
        sockets.registration.unlink()
        with trio.fail_after(10):
            while not sockets.registration.is_socket():  # noqa: ASYNC110
                await trio.sleep(0.05)
        reg = registration_pb2_grpc.RegistrationStub
        info = await kubelet(sockets.registration, reg, "GetInfo", registration_pb2.InfoRequest())
        assert info.name == DRIVER_NAME
