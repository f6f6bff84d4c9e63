"""The daemon's lane hosts: the configured command, the lane's device alone, its VRAM."""

from __future__ import annotations

import pathlib
import sys

import msgspec
import pytest

from machine.lanes import Isolation, Lane, LaneKind
from node.daemon import lane_host_env
from supervisor.lane_host import DEFAULT_COMMAND, LaneHost, LaneHostFailed, lane_host_factory

MIG = Lane(
    lane_id="lane_0123456789abcdef",
    kind=LaneKind.MIG,
    device_id="GPU-aaaa",
    visible_uuid="MIG-bbbb",
    accepts=frozenset({Isolation.PARTITIONED}),
    vram_bytes=5 * 2**30,
)
CPU = Lane(
    lane_id="lane_fedcba9876543210",
    kind=LaneKind.CPU,
    device_id="cpu",
    visible_uuid=None,
    accepts=frozenset({Isolation.SHARED}),
)


def _backend(host: LaneHost) -> str:
    return host._argv[host._argv.index("--backend") + 1]


def test_a_gpu_lanes_host_sees_only_its_own_device_and_budget() -> None:
    host = lane_host_factory()(MIG)
    assert host.memory_bytes == 5 * 2**30
    assert host._argv[: len(DEFAULT_COMMAND)] == list(DEFAULT_COMMAND)
    assert host._env["CUDA_VISIBLE_DEVICES"] == "MIG-bbbb"
    cpu = lane_host_factory(["/opt/host", "--x"])(CPU)
    assert cpu._argv[:2] == ["/opt/host", "--x"] and cpu.memory_bytes == 0
    assert cpu._env["CUDA_VISIBLE_DEVICES"] == ""  # no device at all


def test_each_lane_gets_its_own_backend_and_a_device_lane_is_never_numpy_by_default() -> None:
    """The backend is decided per lane (`Lane.array_backend`), not once for the node:
    `auto` used to reach the host and fall back to NumPy on a real GPU."""
    factory = lane_host_factory()
    assert (_backend(factory(MIG)), factory(MIG).backend) == ("cupy", "cupy")
    assert _backend(factory(CPU)) == "numpy"  # no device: nothing else makes sense
    simulated = msgspec.structs.replace(MIG, backend="numpy")
    assert _backend(factory(simulated)) == "numpy"
    assert _backend(lane_host_factory(backend="numpy")(MIG)) == "numpy"  # asked by name
    assert _backend(lane_host_factory(backend="cupy")(CPU)) == "numpy"


def test_the_daemons_variables_reach_every_host(tmp_path: pathlib.Path) -> None:
    env = lane_host_env(tmp_path)
    assert pathlib.Path(env["CUPY_CACHE_DIR"]).is_dir()  # `import cupy` makes it otherwise
    for lane in (MIG, CPU):
        host = lane_host_factory(env=env)(lane)
        assert host._env["CUPY_CACHE_DIR"] == env["CUPY_CACHE_DIR"]
        assert host._env["CUDA_CACHE_PATH"] == env["CUDA_CACHE_PATH"]


async def test_a_host_command_that_cannot_start_fails_typed() -> None:
    host = lane_host_factory(["/nonexistent/lane-host"])(MIG)
    with pytest.raises(LaneHostFailed) as failed:
        await host.start()
    assert failed.value.reason == "start_failed"


async def test_a_host_the_daemon_finds_through_its_pythonpath_starts(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host runs the daemon's interpreter on the daemon's module path, so it
    starts wherever the daemon's own imports come from; an empty or relative
    entry (the working directory, which `-P` keeps out) is not passed on."""
    modules = tmp_path / "modules"
    (modules / "pathonly_host").mkdir(parents=True)
    (modules / "pathonly_host" / "__main__.py").write_text(
        "from lanehost.host import main\nraise SystemExit(main())\n"
    )
    workdir = tmp_path / "work"
    workdir.mkdir()
    marker = tmp_path / "planted-code-ran"
    (workdir / "numpy.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("PYTHONPATH", f":.:work:{modules}")
    command = (sys.executable, "-P", "-m", "pathonly_host")
    async with lane_host_factory(command, backend="numpy")(CPU) as host:
        assert host.hello.backend == "numpy"
        assert await host.run("noop") == {}
    assert host._env["PYTHONPATH"] == str(modules)
    assert not marker.exists()
