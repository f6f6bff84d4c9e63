"""What a deployed node says at start when it cannot do its job: nothing allocatable
(a warning in the log and in /readyz notes), or NVML demanded and no GPU found (not ready,
with a named reason)."""

from __future__ import annotations

import logging
import pathlib

import httpx
import msgspec
import pytest

from api.errors import ErrorEnvelope
from tests.api_fixtures import running_daemon
from tests.fakes.fake_pynvml import FakeNvml

HUGE = str(1 << 60)  # more than any machine has


async def test_nothing_allocatable_is_a_logged_warning_and_a_readyz_note(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="node.daemon")
    argv = ("--reserved-memory", HUGE, "--reserved-cpu", HUGE)
    async with (
        running_daemon(tmp_path, *argv) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        ready = await client.get("/readyz")
        assert ready.status_code == 200
        notes = ready.json()["notes"]
        assert notes["capacity:memory"].startswith("no_allocatable_memory: --reserved-memory")
        assert notes["capacity:cpu"].startswith("no_allocatable_cpu: --reserved-cpu")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("no_allocatable_memory") for m in warned), warned
    assert any(m.startswith("no_allocatable_cpu") for m in warned), warned


async def test_a_node_with_room_has_no_capacity_note(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path, "--reserved-memory", "0", "--reserved-cpu", "0") as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        notes = (await client.get("/readyz")).json()["notes"]
        assert not any(key.startswith("capacity:") for key in notes), notes


async def test_demanded_nvml_that_finds_no_gpu_is_not_ready_and_says_why(
    tmp_path: pathlib.Path,
) -> None:
    no_gpus = FakeNvml([])  # the driver answers, and there is no device
    async with (
        running_daemon(tmp_path, devices="nvml", pynvml_module=no_gpus) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        error = msgspec.json.decode(ready.content, type=ErrorEnvelope).error
        assert error.details["reasons"]["devices"].startswith("no_gpus: ")
    async with (
        running_daemon(tmp_path, devices="auto", pynvml_module=FakeNvml([])) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        ready = await client.get("/readyz")  # asked for auto: ready, with a note
        assert ready.status_code == 200
        assert ready.json()["notes"]["devices"].startswith("no_gpus: ")
