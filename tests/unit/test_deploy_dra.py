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

from kubeplugin.claim_config import passthrough_requests
from kubeplugin.sockets import DRIVER_NAME
from machine.sim_spec import load_sim_spec
from tests.unit.test_deploy import daemonset, daemonset_config

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"
VERSIONS = ("1.34", "1.35", "1.36", "1.37")


def _documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


@pytest.mark.parametrize(
    "manifest", ["daemonset.yaml", "dra-driver.yaml", "passthrough-class.yaml"]
)
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


def test_the_daemonset_serves_the_plugin_where_kubelet_and_the_runtime_look() -> None:
    found = daemonset()
    spec = found["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    config = daemonset_config(container)
    assert config.kubelet_plugin and config.kube_node_name
    env = {item["name"]: item for item in container["env"]}
    node_name = env["LITEGRAPH_NODE_KUBE_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert node_name == "spec.nodeName"  # the pool is the node the pod runs on
    # The folders at the host's own paths: a claim's CDI spec names host paths.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    served = {mounts[name]: host[name] for name in host if name in mounts}
    kubelet = pathlib.PurePosixPath(config.kubelet_dir)
    for folder in (kubelet / "plugins", kubelet / "plugins_registry", config.cdi_dir):
        assert served.get(str(folder)) == str(folder), folder
    # One driver pod per node at a time; its service account is the one with rights.
    assert found["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0
    (account,) = [d for d in _documents("dra-driver.yaml") if d["kind"] == "ServiceAccount"]
    assert spec["serviceAccountName"] == account["metadata"]["name"]
    assert found["metadata"]["namespace"] == account["metadata"]["namespace"]
    assert spec["automountServiceAccountToken"] is True
    # A machine without its GPU stays unready, never restarted for it.
    for probe in ("livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz"


@pytest.mark.parametrize("example", sorted(p.name for p in (DEPLOY / "examples").glob("*.yaml")))
def test_every_example_pod_spec_is_one_each_supported_kubernetes_takes(example: str) -> None:
    documents = _documents(f"examples/{example}")
    for document in documents:
        for version in VERSIONS:
            kubernetes_validate.validate(document, version, strict=True)
    (pod,) = [d for d in documents if d["kind"] == "Pod"]
    classes = {
        request["exactly"]["deviceClassName"]
        for template in documents
        if template["kind"] == "ResourceClaimTemplate"
        for request in template["spec"]["spec"]["devices"]["requests"]
    }
    (container,) = pod["spec"]["containers"]
    limits = container["resources"].get("limits", {})
    # Each asks for one of the driver's classes, by a claim or by its extended resource.
    extended = {d["spec"]["extendedResourceName"]: d["metadata"]["name"] for d in _classes()}
    asked = classes | {extended[name] for name in limits if name in extended}
    assert len(asked) == 1 and asked <= set(extended.values()), asked


def _classes() -> list[dict[str, Any]]:
    return [d for d in _documents("dra-driver.yaml") if d["kind"] == "DeviceClass"]


def _merged(base: Any, patch: Any) -> Any:
    """A strategic merge patch as kubectl applies this one: maps merged, null removes,
    and lists of named items (containers, env, mounts, volumes) merged by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = _merged(base.get(key), value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and all("name" in p for p in patch):
        by_name = {item["name"]: item for item in base}
        for item in patch:
            by_name[item["name"]] = _merged(by_name.get(item["name"]), item)
        return list(by_name.values())
    return patch


def test_the_kind_walk_throughs_node_simulates_a_whole_a_shared_and_a_mig_gpu() -> None:
    patch = yaml.safe_load((DEPLOY / "kind" / "sim-patch.yaml").read_text())
    patched = _merged(daemonset(), patch)
    for version in VERSIONS:
        kubernetes_validate.validate(patched, version, strict=True)
    spec = patched["spec"]["template"]["spec"]
    assert "runtimeClassName" not in spec  # kind has no nvidia runtime class
    (container,) = spec["containers"]
    config = daemonset_config(container)
    assert config.devices.value == "sim" and config.kubelet_plugin
    sim = load_sim_spec(DEPLOY / "kind" / "sim-node.toml")
    # The ConfigMap's file is where the daemon reads it.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert config.sim_file == f"{mounts['sim']}/sim-node.toml"
    whole = [g.uuid for g in sim.gpus if not g.mig_enabled]
    assert config.kube_shared_gpus == (whole[1],)  # one whole GPU, one shared
    assert [len(g.mig) for g in sim.gpus if g.mig_enabled] == [2]


def test_the_passthrough_class_asks_for_what_the_driver_passes_through() -> None:
    (found,) = _documents("passthrough-class.yaml")
    # The allocation carries a class's config as FromClass, for every request.
    config = [{"source": "FromClass", **entry} for entry in found["spec"]["config"]]
    allocation = {"devices": {"config": config}}
    asked = frozenset({found["metadata"]["name"]})  # the one class the claim asks for
    assert passthrough_requests(allocation, frozenset({"gpu"}), DRIVER_NAME, asked) == {"gpu"}
    selector = found["spec"]["selectors"][0]["cel"]["expression"]
    assert '.type == "gpu"' in selector  # whole GPUs: a shared one is never passed through
