"""The DRA driver in the daemon, end to end, against a fake kubelet (grpcio on the
plugin's own sockets) and a fake API server on loopback (the real client library):
a whole GPU, a MIG instance and a VRAM slice are published, prepared (held in the
ledger and the journal, tokens bound to the claim's own socket, a CDI spec), used by
a pod-like process for a matmul through its token alone, kept across a daemon
restart, and unprepared with everything released."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pathlib
import shutil
import stat
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import kubernetes_validate
import numpy as np
import pytest
import trio

from kubeplugin.cdi import CLAIM_MOUNT
from kubeplugin.contracts import (
    dra_health_pb2,
    dra_pb2,
    dra_pb2_grpc,
    registration_pb2,
    registration_pb2_grpc,
)
from kubeplugin.sockets import DRIVER_NAME
from machine.lanes import lane_id_for
from node.daemon import Daemon, StartupError
from tests.api_fixtures import RunningDaemon, daemon_config, running_daemon
from tests.confinement.test_guest_lane_matmul import MATMUL, M, N, _matrix
from tests.kube_fixtures import (
    FakeApiServer,
    client_for,
    fake_api_server,
    health_stream,
    kubelet,
)
from tests.unit.kubeplugin.test_cdi_schema import VALIDATOR as CDI_VALIDATOR

NODE = "node-a"
WHOLE, SHARED, MIGGED = (f"GPU-5e1d0a3c-0000-4000-8000-5157a000000{i}" for i in (1, 2, 3))
MIG = "MIG-5e1d0a3c-0000-4000-8000-5157a0030001"
SIM = f"""
[cpu]
logical_cores = 4
model = "sim"
[memory]
total = "16GiB"
available = "16GiB"
[[gpus]]
uuid = "{WHOLE}"
name = "LiteGraph SimGPU 4GB"
pci_bus_id = "00000000:01:00.0"
memory = "4GiB"
compute_capability = "8.6"
[[gpus]]
uuid = "{SHARED}"
name = "LiteGraph SimGPU 4GB"
memory = "4GiB"
[[gpus]]
uuid = "{MIGGED}"
name = "LiteGraph SimGPU 4GB"
memory = "4GiB"
mig_enabled = true
[[gpus.mig]]
uuid = "{MIG}"
name = "1g.2gb"
memory = "2GiB"
gpu_instance_id = 1
"""
# One claim per lane kind, each for one pod.
CLAIMS = {
    "whole": ("3a1f0c2e-1111-4a5b-9c6d-0e1f2a3b4c01", f"gpu-{lane_id_for(WHOLE)[5:]}", None),
    "mig": ("3a1f0c2e-2222-4a5b-9c6d-0e1f2a3b4c02", f"mig-{lane_id_for(MIG)[5:]}", None),
    "vram": ("3a1f0c2e-3333-4a5b-9c6d-0e1f2a3b4c03", f"vram-{lane_id_for(SHARED)[5:]}", "1Gi"),
}
VERSIONS = ("1.34", "1.35", "1.36", "1.37")


def claim_doc(uid: str, name: str, device: str, memory: str | None) -> dict[str, Any]:
    result: dict[str, Any] = {
        "request": "lane", "driver": DRIVER_NAME, "pool": NODE, "device": device,
    }  # fmt: skip
    if memory is not None:
        result |= {
            "shareID": "6b7e1c2a-0d4f-4a9b-8c3e-7f1a2b3c4d5e",
            "consumedCapacity": {"memory": memory},
        }
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "team-a", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "lane", "exactly": {"deviceClassName": "x"}}]}},
        "status": {
            "allocation": {"devices": {"results": [result]}},
            "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": f"pod-{uid[:8]}"}],
        },
    }  # fmt: skip


@contextlib.contextmanager
def kubelet_root() -> Iterator[pathlib.Path]:
    base = pathlib.Path(tempfile.mkdtemp(prefix="lg-k-", dir="/tmp"))  # short socket paths
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextlib.asynccontextmanager
async def kube_node(
    tmp_path: pathlib.Path, root: pathlib.Path, api: FakeApiServer, *more: str
) -> AsyncIterator[RunningDaemon]:
    sim = tmp_path / "sim.toml"
    sim.write_text(SIM)

    def with_client(daemon: Daemon) -> None:
        daemon.kube_client = lambda: client_for(api.url)

    argv = (
        "--sim-file", str(sim), "--kubelet-plugin", "--kube-node-name", NODE,
        "--kubelet-dir", str(root), "--cdi-dir", str(root / "cdi"),
        "--kube-shared-gpus", json.dumps([SHARED]), *more,
    )  # fmt: skip
    async with running_daemon(tmp_path, *argv, prepare=with_client) as node:
        yield node


def _claims(*keys: str) -> list[Any]:
    return [dra_pb2.Claim(namespace="team-a", uid=CLAIMS[k][0], name=k) for k in keys]


async def published(api: FakeApiServer) -> list[dict[str, Any]]:
    with trio.fail_after(20):
        while not api.slices:  # noqa: ASYNC110 - the first round runs at start
            await trio.sleep(0.05)
    return [d for s in api.slices.values() for d in s["spec"]["devices"]]


def cdi_spec(root: pathlib.Path, uid: str) -> dict[str, Any]:
    """The claim's CDI spec, which the CDI specification's JSON Schema takes."""
    spec: dict[str, Any] = json.loads(
        (root / "cdi" / f"{DRIVER_NAME}-claim_{uid}.json").read_text()
    )
    assert list(CDI_VALIDATOR.iter_errors(spec)) == []
    return spec


def pod_env(root: pathlib.Path, uid: str) -> dict[str, str]:
    """The environment the claim's CDI spec gives its containers, with the claim's folder
    where the container would see it mounted (no container here: its host path)."""
    (device,) = cdi_spec(root, uid)["devices"]
    (mount,) = device["containerEdits"]["mounts"]
    env = dict(item.split("=", 1) for item in device["containerEdits"]["env"])
    return {k: v.replace(CLAIM_MOUNT, mount["hostPath"]) for k, v in env.items()}


async def pod_matmul(env: dict[str, str]) -> np.ndarray:
    done = await trio.run_process(
        [sys.executable, "-c", MATMUL],
        env={"PATH": os.environ["PATH"], **env},
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    reply = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return np.frombuffer(base64.b64decode(reply["product"]), np.float32).reshape(M, N)


async def lane_call(socket_path: str, lane: str, token: str) -> httpx.Response:
    transport = httpx.AsyncHTTPTransport(uds=socket_path)
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        return await client.post(
            f"/v1/lanes/{lane}/work",
            json={"op": "memory_reserve", "dtype": "float32", "shape": [2]},
            headers={"Authorization": f"Bearer {token}"},
        )


def token_of(env: dict[str, str]) -> str:
    return pathlib.Path(env["LITEGRAPH_CAPABILITY_TOKEN_FILE"]).read_text().strip()


def code_of(reply: httpx.Response) -> tuple[int, str]:
    return reply.status_code, reply.json()["error"]["code"]


def check_pod_files(env: dict[str, str]) -> None:
    token_file = pathlib.Path(env["LITEGRAPH_CAPABILITY_TOKEN_FILE"])
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o444  # a pod of any uid reads it
    assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o755
    assert stat.S_IMODE(token_file.parent.parent.stat().st_mode) == 0o700
    assert stat.S_ISSOCK(os.stat(env["LITEGRAPH_NODE_SOCKET"]).st_mode)


def standing(node: RunningDaemon) -> dict[str, Any]:
    machine = node.daemon.machine
    assert machine is not None
    return {k: r for k, r in machine.ledger.reservations().items() if r.standing}


async def test_three_lane_kinds_are_published_prepared_used_kept_and_unprepared(
    tmp_path: pathlib.Path,
) -> None:
    expected = _matrix(M, 4, 7) @ _matrix(4, N, 3)
    with kubelet_root() as root:
        async with fake_api_server() as api:
            for key, (uid, device, memory) in CLAIMS.items():
                api.claims[("team-a", key)] = claim_doc(uid, key, device, memory)
            registry = root / "plugins_registry" / f"{DRIVER_NAME}-reg.sock"
            service = root / "plugins" / DRIVER_NAME / "dra.sock"
            async with kube_node(tmp_path, root, api) as node:
                devices = {d["name"]: d for d in await published(api)}
                assert set(devices) == {device for _uid, device, _m in CLAIMS.values()}
                for found in api.slices.values():
                    for version in VERSIONS:
                        kubernetes_validate.validate(found, version, strict=True)
                assert devices[CLAIMS["vram"][1]]["allowMultipleAllocations"] is True
                mig = devices[CLAIMS["mig"][1]]["attributes"]
                assert mig["type"] == {"string": "mig"} and mig["parentUUID"] == {"string": MIGGED}
                whole = devices[CLAIMS["whole"][1]]["attributes"]
                assert whole["cudaComputeCapability"] == {"version": "8.6.0"}

                info = await kubelet(
                    registry, registration_pb2_grpc.RegistrationStub, "GetInfo",
                    registration_pb2.InfoRequest(),
                )  # fmt: skip
                assert (info.name, info.endpoint) == (DRIVER_NAME, str(service))
                ask = dra_pb2.NodePrepareResourcesRequest(claims=_claims("whole", "mig", "vram"))
                stub = dra_pb2_grpc.DRAPluginStub
                answers = (await kubelet(service, stub, "NodePrepareResources", ask)).claims
                assert {uid: a.error for uid, a in answers.items()} == {
                    uid: "" for uid, _d, _m in CLAIMS.values()
                }
                held = standing(node)
                assert len(held) == 3
                async with httpx.AsyncClient(base_url=node.url) as scraper:
                    scraped = (await scraper.get("/metrics")).text
                assert "litegraph_claims_held 3.0" in scraped.splitlines()
                assert [
                    r.vram_bytes for h in held.values() for r in h.lanes if not r.exclusive
                ] == [1 << 30]
                envs = {key: pod_env(root, uid) for key, (uid, _d, _m) in CLAIMS.items()}
                for env in envs.values():
                    check_pod_files(env)
                for key, env in envs.items():
                    np.testing.assert_allclose(await pod_matmul(env), expected, rtol=1e-6), key

                # A token copied out of one claim's pods works in no other's, nor on the
                # node's own sockets.
                whole_env, vram_env = envs["whole"], envs["vram"]
                copied = token_of(whole_env)
                lane = whole_env["LITEGRAPH_LANE_IDS"]
                refused = await lane_call(vram_env["LITEGRAPH_NODE_SOCKET"], lane, copied)
                assert (refused.status_code, refused.json()["error"]["code"]) == (
                    403,
                    "wrong_holder",
                )
                async with httpx.AsyncClient(base_url=node.url) as tcp:
                    over_tcp = await tcp.post(
                        f"/v1/lanes/{lane}/work",
                        json={"op": "execute", "kernel": "noop"},
                        headers={"Authorization": f"Bearer {copied}"},
                    )
                assert (over_tcp.status_code, over_tcp.json()["error"]["code"]) == (
                    403,
                    "wrong_holder",
                )
                # The claim's socket serves its lane work alone.
                async with httpx.AsyncClient(
                    transport=httpx.AsyncHTTPTransport(uds=whole_env["LITEGRAPH_NODE_SOCKET"]),
                    base_url="http://node",
                ) as pod:
                    assert (await pod.get("/v1/snapshot")).status_code == 404

            # The daemon restarts: the claims stay held, their pods' files get fresh
            # tokens, and their sockets serve again, with no Prepare.
            async with kube_node(tmp_path, root, api) as node:
                assert set(standing(node)) == set(held)
                again = token_of(whole_env)
                assert again != copied
                stale = await lane_call(whole_env["LITEGRAPH_NODE_SOCKET"], lane, copied)
                assert stale.status_code == 401
                for key, env in envs.items():
                    np.testing.assert_allclose(await pod_matmul(env), expected, rtol=1e-6), key

                # A reboot empties the runtime's CDI folder; kubelet prepares again.
                for spec_file in (root / "cdi").iterdir():
                    spec_file.unlink()
                ask = dra_pb2.NodePrepareResourcesRequest(claims=_claims("whole", "mig", "vram"))
                again_answers = (await kubelet(service, stub, "NodePrepareResources", ask)).claims
                assert again_answers == answers and len(list((root / "cdi").iterdir())) == 3
                assert set(standing(node)) == set(held)  # nothing held twice
                np.testing.assert_allclose(await pod_matmul(envs["vram"]), expected, rtol=1e-6)

                # One claim is deleted already: Unprepare needs only what the node keeps.
                del api.claims[("team-a", "mig")]
                undo = dra_pb2.NodeUnprepareResourcesRequest(claims=_claims("whole", "mig", "vram"))
                for _ in range(2):
                    done = (await kubelet(service, stub, "NodeUnprepareResources", undo)).claims
                    assert {uid: a.error for uid, a in done.items()} == {
                        uid: "" for uid, _d, _m in CLAIMS.values()
                    }
                assert standing(node) == {}
                sup = node.daemon.supervisor
                assert sup is not None and sup.holds.holds == {}
                assert all(not owner.sessions for owner in sup.owners.values())
                assert list((root / "cdi").iterdir()) == []
                assert list((root / "plugins" / DRIVER_NAME / "claims").iterdir()) == []
                with pytest.raises(httpx.ConnectError):  # its socket is gone with it
                    await lane_call(whole_env["LITEGRAPH_NODE_SOCKET"], lane, again)


async def test_claims_the_node_cannot_hold_are_refused_each_with_its_reason(
    tmp_path: pathlib.Path,
) -> None:
    whole_uid, whole_device, _ = CLAIMS["whole"]
    mig_uid, mig_device, _ = CLAIMS["mig"]
    vram_uid, vram_device, _ = CLAIMS["vram"]
    with kubelet_root() as root:
        async with fake_api_server() as api:
            api.claims[("team-a", "whole")] = claim_doc(whole_uid, "whole", whole_device, None)
            # Another claim allocated the same whole GPU (a scheduler out of date).
            twin = "3a1f0c2e-4444-4a5b-9c6d-0e1f2a3b4c04"
            api.claims[("team-a", "twin")] = claim_doc(twin, "twin", whole_device, None)
            api.claims[("team-a", "mig")] = claim_doc(mig_uid, "mig", mig_device, None)
            stranger = "3a1f0c2e-5555-4a5b-9c6d-0e1f2a3b4c05"
            api.claims[("team-a", "stranger")] = claim_doc(stranger, "stranger", "gpu-0", None)
            # A shared device's allocation must say how much of it the claim took.
            api.claims[("team-a", "vram")] = claim_doc(vram_uid, "vram", vram_device, None)
            bare = "3a1f0c2e-6666-4a5b-9c6d-0e1f2a3b4c06"  # not allocated yet
            api.claims[("team-a", "bare")] = claim_doc(bare, "bare", whole_device, None)
            del api.claims[("team-a", "bare")]["status"]["allocation"]
            # kubelet names one claim, the API server holds another under that name.
            named = "3a1f0c2e-7777-4a5b-9c6d-0e1f2a3b4c07"
            api.claims[("team-a", "named")] = claim_doc(bare, "named", whole_device, None)
            service = root / "plugins" / DRIVER_NAME / "dra.sock"
            async with kube_node(tmp_path, root, api) as node:
                await published(api)
                sup, machine = node.daemon.supervisor, node.daemon.machine
                assert sup is not None and machine is not None
                machine.ledger.fault_lane(lane_id_for(MIG), "lane_faulted")
                claims = [
                    dra_pb2.Claim(namespace="team-a", uid=uid, name=name)
                    for name, uid in [
                        ("whole", whole_uid), ("twin", twin), ("mig", mig_uid),
                        ("stranger", stranger), ("vram", vram_uid), ("bare", bare),
                        ("named", named),
                    ]
                ]  # fmt: skip
                ask = dra_pb2.NodePrepareResourcesRequest(claims=claims)
                stub = dra_pb2_grpc.DRAPluginStub
                answers = (await kubelet(service, stub, "NodePrepareResources", ask)).claims
                errors = {uid: a.error.split(":")[0] for uid, a in answers.items()}
                held_one = [errors[whole_uid], errors[twin]]
                assert sorted(held_one) == ["", "lane_held"]
                assert errors[mig_uid] == "lane_unhealthy"
                assert errors[stranger] == "device_unknown"
                assert errors[vram_uid] == "vram_unsized"
                assert errors[bare] == "claim_not_allocated"
                assert errors[named] == "claim_uid_mismatch"
                # kubelet's health stream says so too, for the pods' status.
                async with health_stream(service, 1) as received:
                    with trio.fail_after(20):
                        first = await received.receive()
                health = {d.device.device_name: d for d in first.devices}
                assert set(health) == {CLAIMS[key][1] for key in CLAIMS}
                assert health[mig_device].health == dra_health_pb2.UNHEALTHY
                assert health[mig_device].message == "lane_faulted"
                assert health[whole_device].health == dra_health_pb2.HEALTHY
                # Only the one claim that was given its GPU holds anything.
                assert len(standing(node)) == 1 and len(sup.holds.holds) == 1
                assert len(list((root / "cdi").iterdir())) == 1
                claims_dir = root / "plugins" / DRIVER_NAME / "claims"
                assert len(list(claims_dir.iterdir())) == 1
                # The API server out of reach: a claim it cannot read is that claim's error.
                api.unreachable = True
                later = dra_pb2.NodePrepareResourcesRequest(
                    claims=[dra_pb2.Claim(namespace="team-a", uid=mig_uid, name="mig")]
                )
                (gone,) = (
                    await kubelet(service, stub, "NodePrepareResources", later)
                ).claims.values()
                assert gone.error.startswith("claim_unreadable")
                assert len(standing(node)) == 1 and len(list(claims_dir.iterdir())) == 1


def passthrough_config(source: str) -> list[dict[str, Any]]:
    opaque = {"driver": DRIVER_NAME, "parameters": {"passthrough": True}}
    return [{"source": source, "requests": ["lane"], "opaque": opaque}]


async def test_a_device_class_that_passes_a_gpu_through_gives_its_nodes_and_no_one_else_can(
    tmp_path: pathlib.Path,
) -> None:
    dev = tmp_path / "dev"  # stand-ins for the host's device nodes
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        (dev / name).touch()
    whole_uid, whole_device, _ = CLAIMS["whole"]
    vram_uid, vram_device, _ = CLAIMS["vram"]
    mig_uid, mig_device, _ = CLAIMS["mig"]
    with kubelet_root() as root:
        async with fake_api_server() as api:
            docs = {
                "whole": (claim_doc(whole_uid, "whole", whole_device, None), "FromClass"),
                "vram": (claim_doc(vram_uid, "vram", vram_device, "1Gi"), "FromClass"),
                # A claim's own config cannot grant its writer the device.
                "mig": (claim_doc(mig_uid, "mig", mig_device, None), "FromClaim"),
            }
            for name, (doc, source) in docs.items():
                doc["status"]["allocation"]["devices"]["config"] = passthrough_config(source)
                api.claims[("team-a", name)] = doc
            service = root / "plugins" / DRIVER_NAME / "dra.sock"
            async with kube_node(tmp_path, root, api, "--dev-root", str(dev)) as node:
                await published(api)
                ask = dra_pb2.NodePrepareResourcesRequest(claims=_claims("whole", "vram", "mig"))
                stub = dra_pb2_grpc.DRAPluginStub
                answers = (await kubelet(service, stub, "NodePrepareResources", ask)).claims
                errors = {uid: a.error.split(":")[0] for uid, a in answers.items()}
                assert errors == {
                    whole_uid: "",
                    vram_uid: "passthrough_unsupported",
                    mig_uid: "passthrough_not_allowed",
                }
                assert len(standing(node)) == 1
                spec = json.loads(
                    (root / "cdi" / f"{DRIVER_NAME}-claim_{whole_uid}.json").read_text()
                )
                assert CDI_VALIDATOR.is_valid(spec)
                (device,) = spec["devices"]
                nodes = {n["path"]: n["hostPath"] for n in device["containerEdits"]["deviceNodes"]}
                assert nodes == {
                    f"/dev/{name}": str(dev / name)
                    for name in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
                }  # its own GPU's node and the driver's, no other GPU's
                assert f"CUDA_VISIBLE_DEVICES={WHOLE}" in device["containerEdits"]["env"]
                check_pod_files(pod_env(root, whole_uid))  # and its token, as ever
                # A MIG instance whose capability nodes are not here is no device to CUDA.
                docs["mig"][0]["status"]["allocation"]["devices"]["config"] = passthrough_config(
                    "FromClass"
                )
                ask = dra_pb2.NodePrepareResourcesRequest(claims=_claims("mig"))
                (mig,) = (await kubelet(service, stub, "NodePrepareResources", ask)).claims.values()
                assert mig.error.startswith("passthrough_unavailable")
                assert len(standing(node)) == 1


async def refused_start(tmp_path: pathlib.Path) -> str:
    """Why a daemon with the DRA driver on did not start (its StartupError)."""
    with kubelet_root() as root:
        config = daemon_config(
            tmp_path, "--kubelet-plugin", "--kube-node-name", NODE, "--kubelet-dir", str(root)
        )
        daemon = Daemon(config, handle_signals=False)
        with pytest.raises(StartupError) as refused, trio.fail_after(30):
            await daemon.run()
    return str(refused.value)


async def test_without_the_kubernetes_extra_the_plugin_stops_the_start_saying_so(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "node.kube_driver", None)  # its import fails
    assert "litegraph-node[kubernetes]" in await refused_start(tmp_path)


async def test_without_the_api_servers_credentials_the_plugin_stops_the_start_saying_so(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    said = await refused_start(tmp_path)
    assert said.startswith("--kubelet-plugin: ") and "no-kubeconfig" in said
