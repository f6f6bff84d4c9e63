"""`run`'s options as the request it submits: asking for a device means a GPU lane."""

from __future__ import annotations

from typing import Any

import pytest

from machine.lanes import Requirement
from node.flags import FlagError
from node.run_request import build_request
from supervisor.wire import GuestNetwork, ProcessWork

DEFAULTS: dict[str, Any] = {
    "cpu": "1",
    "memory": "2GiB",
    "gpus": 0,
    "vram": "0",
    "isolation": "shared",
    "requirement": "",
    "env": [],
    "cwd": "",
    "timeout": 3600.0,
    "network": "none",
}


def requirement_of(**options: Any) -> Requirement:
    return build_request({**DEFAULTS, **options}, ["true"], "/srv").requirement


@pytest.mark.parametrize(
    "options",
    [{"gpus": 3}, {"vram": "30GiB"}, {"isolation": "partitioned"}],
    ids=["gpus", "vram", "partitioned"],
)
def test_asking_for_a_device_asks_for_a_gpu_lane_unless_told_otherwise(
    options: dict[str, Any],
) -> None:
    """The report: `run --gpus 3` on a node with 2 GPUs (or `--vram 30GiB`, or a
    drained GPU lane) ran on the CPU lane and exited 0. Now it asks for `gpu`, so it
    gets GPUs or a refusal; `--requirement auto` keeps the fallback for who wants it."""
    assert requirement_of(**options) is Requirement.GPU
    assert requirement_of(**options, requirement="auto") is Requirement.AUTO


def test_no_device_asked_for_is_auto_and_an_explicit_choice_is_kept() -> None:
    assert requirement_of() is Requirement.AUTO
    assert requirement_of(requirement="cpu") is Requirement.CPU
    assert requirement_of(requirement="gpu") is Requirement.GPU


def test_a_bad_requirement_is_named() -> None:
    with pytest.raises(FlagError, match="--requirement: expected one of"):
        requirement_of(requirement="tpu")


def test_run_asks_for_its_own_network_unless_told_host() -> None:
    def network_of(**options: Any) -> GuestNetwork:
        work = build_request({**DEFAULTS, **options}, ["true"], "/srv").work
        assert isinstance(work, ProcessWork)
        return work.network

    assert network_of() is GuestNetwork.NONE
    assert network_of(network="host") is GuestNetwork.HOST
    with pytest.raises(FlagError, match="--network: expected one of none, host"):
        network_of(network="bridge")


def test_run_sends_its_folder_as_cwd_unless_told_another_or_none() -> None:
    def cwd_of(**options: Any) -> str | None:
        work = build_request({**DEFAULTS, **options}, ["true"], "/srv/here").work
        assert isinstance(work, ProcessWork)
        return work.cwd

    assert cwd_of() == "/srv/here"
    assert cwd_of(cwd="/srv/other") == "/srv/other"
    assert cwd_of(cwd="none") is None  # the guest starts in its private /tmp
    with pytest.raises(FlagError, match="--cwd: must be an absolute path, or none to send no"):
        cwd_of(cwd="relative/dir")
