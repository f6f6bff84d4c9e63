"""Claims prepared and unprepared end to end: a fake kubelet's calls, the real client
library against a fake API server, and a node that records what it reserved. Repeats
give the same answer, a reboot's empty CDI folder is written again, an unknown claim's
Unprepare is no error, and a claim that fails leaves nothing behind."""

from __future__ import annotations

import contextlib
import json
import pathlib
import stat
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kubeplugin.claims import ClaimPlan, ClaimRefused
from kubeplugin.contracts import dra_pb2, dra_pb2_grpc
from kubeplugin.files import TOKEN_NAME
from kubeplugin.preparer import ClaimPreparer, Granted
from kubeplugin.server import ClaimRef
from tests.kube_fixtures import client_for, fake_api_server, kubelet, plugin
from tests.unit.kubeplugin.test_claims import ALLOCATED, REF, claim_doc

TOKEN = "v4.public.claim-token"
LANE = "lane_0123456789abcdef"


class Node:
    """What the node holds: claim UID -> plan; refuses claims on a lane it calls busy."""

    def __init__(self) -> None:
        self.held: dict[str, ClaimPlan] = {}
        self.busy: set[str] = set()

    async def reserve(self, plan: ClaimPlan) -> Granted:
        if any(d.device in self.busy for d in plan.devices):
            raise ClaimRefused("lane_held", "gpu-0-shared is held by another claim")
        new = plan.claim.uid not in self.held
        self.held[plan.claim.uid] = plan
        return Granted(lane_ids=(LANE,), tokens=(TOKEN,), new=new)

    async def release(self, claim_uid: str) -> None:
        self.held.pop(claim_uid, None)


def _request(*uids: str) -> Any:
    names = {REF.uid: REF.name}
    claims = [
        dra_pb2.Claim(namespace=REF.namespace, uid=u, name=names.get(u, "gone")) for u in uids
    ]
    return claims


@contextlib.asynccontextmanager
async def preparer_of(node: Node, tmp_path: pathlib.Path) -> AsyncIterator[ClaimPreparer]:
    """A preparer for `node` (claims and CDI folders under `tmp_path`), the API server
    holding REF's claim."""
    async with fake_api_server() as api:
        api.claims[(REF.namespace, REF.name)] = claim_doc(**ALLOCATED)
        client = client_for(api.url)
        try:
            yield ClaimPreparer(
                client, node="node-a", claims_dir=tmp_path / "claims", cdi_dir=tmp_path / "cdi",
                reserve=node.reserve, release=node.release,
            )  # fmt: skip
        finally:
            await client.close()


async def test_a_claim_is_prepared_again_after_a_reboot_and_unprepared_twice(
    tmp_path: pathlib.Path,
) -> None:
    node, claims_dir, cdi_dir = Node(), tmp_path / "claims", tmp_path / "cdi"
    async with preparer_of(node, tmp_path) as preparer:
        async with plugin(preparer) as (sockets, _state):
            stub = dra_pb2_grpc.DRAPluginStub
            ask = dra_pb2.NodePrepareResourcesRequest(claims=_request(REF.uid, "uid-gone"))
            first = await kubelet(sockets.service, stub, "NodePrepareResources", ask)
            ok, gone = first.claims[REF.uid], first.claims["uid-gone"]
            assert ok.error == "" and gone.error.startswith("claim_not_found")
            (device,) = ok.devices
            assert (device.pool_name, device.device_name) == ("node-a", "gpu-0-shared")
            assert list(device.cdi_device_ids) == [f"lanes.litegraph.dev/claim={REF.uid}"]
            assert device.share_id == "5b7e1c2a-0d4f-4a9b-8c3e-7f1a2b3c4d5e"
            token = claims_dir / REF.uid / TOKEN_NAME
            assert token.read_text() == TOKEN + "\n"
            assert stat.S_IMODE(token.stat().st_mode) == 0o444
            assert stat.S_IMODE(token.parent.stat().st_mode) == 0o755
            assert stat.S_IMODE(claims_dir.stat().st_mode) == 0o700  # reached by its pods alone
            spec = json.loads(next(cdi_dir.iterdir()).read_text())
            assert spec["devices"][0]["containerEdits"]["mounts"][0]["hostPath"] == str(
                token.parent
            )
            assert TOKEN not in json.dumps(spec)
            assert list(node.held) == [REF.uid]
            # kubelet again (its restart), then after a reboot emptied the CDI folder.
            again = await kubelet(sockets.service, stub, "NodePrepareResources", ask)
            assert again == first
            for spec_file in cdi_dir.iterdir():
                spec_file.unlink()
            rebooted = await kubelet(sockets.service, stub, "NodePrepareResources", ask)
            assert rebooted == first and len(list(cdi_dir.iterdir())) == 1
            undo = dra_pb2.NodeUnprepareResourcesRequest(claims=_request(REF.uid, "uid-x"))
            for _ in range(2):  # repeated, and a claim never prepared: no error
                done = await kubelet(sockets.service, stub, "NodeUnprepareResources", undo)
                assert {u: e.error for u, e in done.claims.items()} == {
                    REF.uid: "",
                    "uid-x": "",
                }
            assert node.held == {} and list(cdi_dir.iterdir()) == []
            assert list(claims_dir.iterdir()) == []


async def test_a_claim_on_a_lane_held_by_another_is_refused_and_leaves_nothing(
    tmp_path: pathlib.Path,
) -> None:
    node, claims_dir, cdi_dir = Node(), tmp_path / "claims", tmp_path / "cdi"
    node.busy.add("gpu-0-shared")
    async with preparer_of(node, tmp_path) as preparer:
        answers = await preparer.prepare([REF])
    assert answers[REF.uid].error.startswith("lane_held:")
    assert not claims_dir.exists() and not cdi_dir.exists() and node.held == {}


async def test_a_failed_repeat_keeps_what_running_pods_hold_and_a_fault_is_one_claims(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = Node()
    async with preparer_of(node, tmp_path) as preparer:
        assert (await preparer.prepare([REF]))[REF.uid].error == ""

        def disk_full(folder: pathlib.Path, tokens: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr("kubeplugin.preparer.write_tokens", disk_full)
        again = await preparer.prepare([REF])
        assert again[REF.uid].error.startswith("prepare_failed:")
        assert list(node.held) == [REF.uid]  # a repeat's failure revokes nothing
        monkeypatch.undo()

        async def broken(plan: ClaimPlan) -> Granted:
            raise RuntimeError("the journal is closed")

        monkeypatch.setattr(preparer, "_reserve", broken)
        other = ClaimRef(REF.namespace, "uid-gone", "gone")
        answers = await preparer.prepare([REF, other])
        assert answers[REF.uid].error == "prepare_failed: RuntimeError: the journal is closed"
        assert answers["uid-gone"].error.startswith("claim_not_found")
