"""kubeplugin's wire contracts: the stubs are what the .proto files generate, and the
method paths are the kubelet's (they come from the upstream package names)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from kubeplugin.contracts import dra_health_pb2, dra_pb2, registration_pb2
from kubeplugin.health import HEALTH_SERVICE

ROOT = pathlib.Path(__file__).resolve().parents[3]
CONTRACTS = ROOT / "kubeplugin" / "contracts"


def test_the_stubs_are_what_the_contracts_generate(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["sh", "scripts/generate-protos", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    made = sorted(p.name for p in (tmp_path / "kubeplugin" / "contracts").iterdir())
    kept = sorted(p.name for p in CONTRACTS.glob("*_pb2*"))
    assert made == kept
    for name in made:
        fresh = (tmp_path / "kubeplugin" / "contracts" / name).read_text()
        assert fresh == (CONTRACTS / name).read_text(), f"{name} drifted: run `make protos`"


def test_the_method_paths_are_the_kubelets() -> None:
    registration = registration_pb2.DESCRIPTOR.services_by_name["Registration"]
    assert registration.full_name == "pluginregistration.Registration"
    assert sorted(m.name for m in registration.methods) == ["GetInfo", "NotifyRegistrationStatus"]
    node = dra_pb2.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert node.full_name == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    methods = sorted(m.name for m in node.methods)
    assert methods == ["NodePrepareResources", "NodeUnprepareResources"]
    # Field numbers are the wire: kubelet's Device and Claim as upstream numbers them.
    device = dra_pb2.Device.DESCRIPTOR.fields_by_name
    numbers = {name: field.number for name, field in device.items()}
    assert numbers == {
        "request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4, "share_id": 5,
    }  # fmt: skip
    claim = {name: f.number for name, f in dra_pb2.Claim.DESCRIPTOR.fields_by_name.items()}
    assert claim == {"namespace": 1, "uid": 2, "name": 3}


def test_the_health_streams_path_and_fields_are_the_kubelets() -> None:
    service = dra_health_pb2.DESCRIPTOR.services_by_name["DRAResourceHealth"]
    assert service.full_name == HEALTH_SERVICE == "v1alpha1.DRAResourceHealth"
    (method,) = service.methods
    assert method.name == "NodeWatchResources"
    health = dra_health_pb2.DeviceHealth.DESCRIPTOR.fields_by_name
    assert {name: f.number for name, f in health.items()} == {
        "device": 1, "health": 2, "last_updated_time": 3,
        "health_check_timeout_seconds": 4, "message": 5,
    }  # fmt: skip
    assert dra_health_pb2.HealthStatus.Name(2) == "UNHEALTHY"
