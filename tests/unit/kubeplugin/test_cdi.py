"""A prepared claim's CDI spec: CDI's names and fields, the claim's folder mounted,
no device node and never the token; written whole, again after a reboot, and removed
as often as Unprepare comes."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from kubeplugin.cdi import (
    CLAIM_MOUNT,
    CdiError,
    claim_device_id,
    remove_claim_spec,
    spec_path,
    write_claim_spec,
)

UID = "2f6b4c1e-8d0a-4b7e-9c61-0b5d3e1a7f42"
LANES = ("lane_0123456789abcdef", "lane_fedcba9876543210")


def test_the_spec_names_the_claim_and_mounts_only_its_folder(tmp_path: pathlib.Path) -> None:
    claim_dir = tmp_path / "claims" / UID
    written = write_claim_spec(UID, claim_dir, LANES, cdi_dir=tmp_path / "cdi")
    assert written == tmp_path / "cdi" / f"lanes.litegraph.dev-claim_{UID}.json"
    assert written.stat().st_mode & 0o777 == 0o644
    spec = json.loads(written.read_text())
    assert set(spec) == {"cdiVersion", "kind", "devices"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", spec["cdiVersion"])
    assert spec["kind"] == "lanes.litegraph.dev/claim"
    (device,) = spec["devices"]
    assert device["name"] == UID and claim_device_id(UID) == f"lanes.litegraph.dev/claim={UID}"
    edits = device["containerEdits"]
    assert set(edits) == {"env", "mounts"}  # mediated: no deviceNodes, no hooks
    (mount,) = edits["mounts"]
    assert (mount["hostPath"], mount["containerPath"]) == (str(claim_dir), CLAIM_MOUNT)
    assert {"nosuid", "nodev", "noexec"} <= set(mount["options"])
    # The token's path, never the token: nothing in the spec looks like one.
    assert "v4.public." not in written.read_text()
    assert f"LITEGRAPH_CAPABILITY_TOKEN_FILE={CLAIM_MOUNT}/token" in edits["env"]
    assert f"LITEGRAPH_LANE_IDS={','.join(LANES)}" in edits["env"]
    assert f"LITEGRAPH_NODE_SOCKET={CLAIM_MOUNT}/node.sock" in edits["env"]


def test_prepare_and_unprepare_may_come_again(tmp_path: pathlib.Path) -> None:
    cdi = tmp_path / "cdi"
    first = write_claim_spec(UID, tmp_path / "a", LANES, cdi_dir=cdi)
    first.unlink()  # a reboot empties the runtime's tmpfs
    again = write_claim_spec(UID, tmp_path / "a", LANES, cdi_dir=cdi)
    assert again == first and again.exists()
    assert [p.name for p in cdi.iterdir()] == [again.name]  # nothing left aside
    assert remove_claim_spec(UID, cdi_dir=cdi) is True
    assert remove_claim_spec(UID, cdi_dir=cdi) is False
    assert list(cdi.iterdir()) == []


@pytest.mark.parametrize("bad", ["", "../etc", "a/b", "-lead", "x" * 64])
def test_a_uid_that_cannot_name_a_cdi_device_is_refused(tmp_path: pathlib.Path, bad: str) -> None:
    with pytest.raises(CdiError):
        spec_path(bad, cdi_dir=tmp_path)
    with pytest.raises(CdiError):
        write_claim_spec(bad, tmp_path / "claim", LANES, cdi_dir=tmp_path / "cdi")
    assert not (tmp_path / "cdi").exists() or list((tmp_path / "cdi").iterdir()) == []
