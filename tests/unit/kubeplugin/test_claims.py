"""A ResourceClaim read from the API server and turned into what to prepare here, or a
typed per-claim reason why not."""

from __future__ import annotations

from typing import Any

import pytest

from kubeplugin.claim_config import ConfigRefused, passthrough_requests
from kubeplugin.claims import (
    AllocatedDevice,
    ClaimRefused,
    _classes,
    _quantity,
    plan_claim,
    read_claim,
)
from kubeplugin.server import ClaimRef
from kubeplugin.sockets import DRIVER_NAME
from tests.kube_fixtures import client_for, fake_api_server

REF = ClaimRef(namespace="team-a", uid="9d1c0e52-7a43-4f1b-bc7e-6a2e8f0d4c11", name="train-gpu")
POD = "0f6a3c7e-2b1d-4e8a-9f5c-1d7b3a9e6c20"
VRAM_CLASS = {"deviceClassName": "vram.lanes.litegraph.dev"}
# A device of another driver, allocated to the same claim: that driver's to prepare.
NIC = {"request": "nic", "driver": "nics.example.com", "pool": "node-a", "device": "eth1"}


def claim_doc(**status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": REF.name, "namespace": REF.namespace, "uid": REF.uid},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "vram", "exactly": {"deviceClassName": "vram.lanes.litegraph.dev"}}
                ]
            }
        },
        "status": status,
    }


RESULT = {
    "request": "vram",
    "driver": "lanes.litegraph.dev",
    "pool": "node-a",
    "device": "gpu-0-shared",
    "shareID": "5b7e1c2a-0d4f-4a9b-8c3e-7f1a2b3c4d5e",
}
ALLOCATED = {
    "allocation": {
        "devices": {
            "results": [
                {
                    "request": "vram",
                    "driver": "lanes.litegraph.dev",
                    "pool": "node-a",
                    "device": "gpu-0-shared",
                    "shareID": "5b7e1c2a-0d4f-4a9b-8c3e-7f1a2b3c4d5e",
                    "consumedCapacity": {"memory": "20Gi"},
                },
                {
                    "request": "nic",
                    "driver": "nics.example.com",
                    "pool": "node-a",
                    "device": "eth1",
                },
            ]
        }
    },
    "reservedFor": [{"resource": "pods", "name": "train-0", "uid": POD}],
}


def test_an_allocated_claim_is_its_devices_share_and_pods_here() -> None:
    plan = plan_claim(REF, claim_doc(**ALLOCATED), node="node-a")
    assert plan.devices == (
        AllocatedDevice(
            request="vram",
            device="gpu-0-shared",
            share_id="5b7e1c2a-0d4f-4a9b-8c3e-7f1a2b3c4d5e",
            memory_bytes=20 << 30,
        ),
    )  # fmt: skip  (the other driver's result is its own)
    assert plan.pod_uids == (POD,)


@pytest.mark.parametrize(
    ("claim", "reason"),
    [
        (claim_doc(), "claim_not_allocated"),
        ({**claim_doc(**ALLOCATED), "metadata": {"uid": "someone-else"}}, "claim_uid_mismatch"),
        (
            claim_doc(
                allocation={
                    "devices": {"results": [ALLOCATED["allocation"]["devices"]["results"][1]]}
                }
            ),
            "claim_not_ours",
        ),
    ],
)
def test_a_claim_that_cannot_be_prepared_here_says_why(claim: dict[str, Any], reason: str) -> None:
    with pytest.raises(ClaimRefused) as refused:
        plan_claim(REF, claim, node="node-a")
    assert refused.value.reason == reason
    with pytest.raises(ClaimRefused) as elsewhere:
        plan_claim(REF, claim_doc(**ALLOCATED), node="node-b")
    assert elsewhere.value.reason == "claim_other_node"


async def test_a_claim_is_read_through_the_api_server_or_refused_with_a_reason() -> None:
    async with fake_api_server() as api:
        api.claims[(REF.namespace, REF.name)] = claim_doc(**ALLOCATED)
        client = client_for(api.url)
        try:
            found = await read_claim(client, REF)
            assert plan_claim(REF, found, node="node-a").pod_uids == (POD,)
            with pytest.raises(ClaimRefused) as missing:
                await read_claim(client, ClaimRef(REF.namespace, "uid-x", "gone"))
            assert missing.value.reason == "claim_not_found"
        finally:
            await client.close()
        url = api.url
    closed = client_for(url)
    try:
        with pytest.raises(ClaimRefused) as unreachable:
            await read_claim(closed, REF)
        assert unreachable.value.reason == "claim_unreadable"
    finally:
        await closed.close()


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("20Gi", 20 << 30), ("1.5Gi", 3 << 29), ("1500M", 1_500_000_000), ("1e9", 10**9),
        ("1E3", 1000), ("2Ti", 2 << 40), ("1Pi", 1 << 50), ("1Ei", 1 << 60), ("3E", 3 * 10**18),
        ("1073741824", 1 << 30), ("0.5", 1), (".5Ki", 512),
    ],
)  # fmt: skip
def test_every_form_the_api_server_writes_a_quantity_in_is_read(text: str, count: int) -> None:
    memory = {**RESULT, "consumedCapacity": {"memory": text}}
    plan = plan_claim(REF, claim_doc(allocation={"devices": {"results": [memory]}}), node="node-a")
    assert plan.devices[0].memory_bytes == count


@pytest.mark.parametrize("text", ["abc", "-1Gi", "1Gb", "", "1.2.3Gi"])
def test_a_quantity_that_is_none_is_a_malformed_claim(text: str) -> None:
    memory = {**RESULT, "consumedCapacity": {"memory": text}}
    with pytest.raises(ClaimRefused) as refused:
        plan_claim(REF, claim_doc(allocation={"devices": {"results": [memory]}}), node="node-a")
    assert refused.value.reason == "claim_malformed"


def _configured(*config: dict[str, Any]) -> dict[str, Any]:
    return claim_doc(allocation={"devices": {"results": [RESULT], "config": list(config)}})


def _opaque(parameters: object, driver: str = "lanes.litegraph.dev") -> dict[str, Any]:
    return {"driver": driver, "parameters": parameters}


def test_only_a_device_class_may_pass_a_device_through() -> None:
    plan = plan_claim(REF, claim_doc(allocation={"devices": {"results": [RESULT]}}), node="node-a")
    assert not plan.devices[0].passthrough  # mediated by default
    given = _configured({"source": "FromClass", "opaque": _opaque({"passthrough": True})})
    assert plan_claim(REF, given, node="node-a").devices[0].passthrough
    other = _configured(
        {"source": "FromClass", "requests": ["nic"], "opaque": _opaque({"passthrough": True})}
    )
    assert not plan_claim(REF, other, node="node-a").devices[0].passthrough  # not its request
    theirs = _configured({"source": "FromClass", "opaque": _opaque({"x": 1}, "nics.example.com")})
    assert not plan_claim(REF, theirs, node="node-a").devices[0].passthrough


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        (
            {"source": "FromClaim", "opaque": _opaque({"passthrough": True})},
            "passthrough_not_allowed",
        ),
        ({"source": "FromClass", "opaque": _opaque({"passthrough": "yes"})}, "claim_malformed"),
        ({"source": "FromClass", "opaque": _opaque({"devices": "all"})}, "claim_malformed"),
    ],
)
def test_a_config_the_driver_cannot_take_refuses_the_claim(
    entry: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ClaimRefused) as refused:
        plan_claim(REF, _configured(entry), node="node-a")
    assert refused.value.reason == reason


def test_a_class_config_that_names_no_request_is_taken_only_where_it_can_be_no_other() -> None:
    # Schedulers before 1.35 name no request in a class's config.
    config = [{"source": "FromClass", "opaque": _opaque({"passthrough": True})}]
    alloc = {"devices": {"config": config}}
    one = frozenset({"gpu.lanes.litegraph.dev"})
    assert passthrough_requests(alloc, frozenset({"a", "b"}), DRIVER_NAME, one) == {"a", "b"}
    two = one | {"vram.lanes.litegraph.dev"}
    with pytest.raises(ConfigRefused) as refused:
        passthrough_requests(alloc, frozenset({"a", "b"}), DRIVER_NAME, two)
    assert refused.value.reason == "passthrough_ambiguous"
    # A subrequest's result (`req/sub`) is its request's, as Kubernetes matches configs.
    named = [{"source": "FromClass", "requests": ["gpu"], "opaque": _opaque({"passthrough": True})}]
    found = passthrough_requests(
        {"devices": {"config": named}}, frozenset({"gpu/big", "x"}), DRIVER_NAME
    )
    assert found == {"gpu/big"}


def test_the_classes_a_claims_requests_ask_for_are_read_from_its_spec() -> None:
    doc = claim_doc(allocation={"devices": {"results": [RESULT]}})
    doc["spec"]["devices"]["requests"].append(
        {"name": "pick", "firstAvailable": [{"name": "big", "deviceClassName": "gpu.x"}]}
    )
    assert _classes(doc, frozenset({"vram", "pick/big"})) == {"vram.lanes.litegraph.dev", "gpu.x"}
    assert _classes(doc, frozenset({"vram"})) == {"vram.lanes.litegraph.dev"}


@pytest.mark.parametrize("text", ["1e999999999", "1e-999999999", "1e1000000", "9" * 70, "1e30"])
def test_a_quantity_past_any_byte_count_is_refused_at_once(text: str) -> None:
    with pytest.raises(ValueError, match="quantity"):
        _quantity(text)
