"""The Kubernetes manifests: every one what the API server of 1.34 to 1.37 takes
(kubernetes-validate, strict), and the DRA driver's pieces agreeing with each other and
with what the node publishes."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kubeplugin.sockets import DRIVER_NAME

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"
VERSIONS = ("1.34", "1.35", "1.36", "1.37")


def _documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


@pytest.mark.parametrize("manifest", ["daemonset.yaml", "dra-driver.yaml"])
def test_every_manifest_is_one_each_supported_kubernetes_takes(manifest: str) -> None:
    for document in _documents(manifest):
        for version in VERSIONS:
            kubernetes_validate.validate(document, version, strict=True)


def test_the_drivers_classes_rights_and_policy_agree() -> None:
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for document in _documents("dra-driver.yaml"):
        by_kind.setdefault(document["kind"], []).append(document)
    classes = {c["metadata"]["name"]: c for c in by_kind["DeviceClass"]}
    assert sorted(classes) == [f"{kind}.{DRIVER_NAME}" for kind in ("gpu", "mig", "vram")]
    for name, device_class in classes.items():
        (selector,) = device_class["spec"]["selectors"]
        expression = selector["cel"]["expression"]
        assert f'device.driver == "{DRIVER_NAME}"' in expression
        assert re.search(rf'\.type == "{name.split(".")[0]}"', expression), expression
    (role,) = by_kind["ClusterRole"]
    rights = {(r["resources"][0], tuple(r["verbs"])) for r in role["rules"]}
    assert ("resourceclaims", ("get",)) in rights  # claims are read, never written
    (account,) = by_kind["ServiceAccount"]
    user = f"system:serviceaccount:{account['metadata']['namespace']}:{account['metadata']['name']}"
    (policy,) = by_kind["ValidatingAdmissionPolicy"]
    assert user in policy["spec"]["matchConditions"][0]["expression"]
    (binding,) = by_kind["ValidatingAdmissionPolicyBinding"]
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
