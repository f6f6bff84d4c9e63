"""Operator kernels from entry points: loaded at host start, a broken one skipped,
a failing one answered with `kernel_failed`; a guest can only name them."""

from __future__ import annotations

import logging
import pathlib
import textwrap

import pytest

from lanehost.kernels import BUILTIN_KERNELS, ENTRY_POINT_GROUP, load_kernels
from supervisor.lane_host import LaneHost, LaneHostError

PLUGIN = """
from lanehost.kernels import Kernel, KernelError

def _scale(xp, args, buffers):
    buffers["x"] *= args["by"]
    return {"scaled": int(buffers["x"].size)}

def _boom(xp, args, buffers):
    raise ZeroDivisionError("boom")

def _refuse(xp, args, buffers):
    raise KernelError("shape_mismatch", "not this shape")

def _odd_result(xp, args, buffers):
    return {"array": [1, 2, 3]}

scale = Kernel("scale", _scale, frozenset({"by"}), frozenset({"x"}))
boom = Kernel("boom", _boom)
refuse = Kernel("refuse", _refuse)
odd_result = Kernel("odd_result", _odd_result)
shadow = Kernel("fill", _boom)
not_a_kernel = 42
"""

ENTRY_POINTS = f"""
[{ENTRY_POINT_GROUP}]
scale = site_kernels:scale
boom = site_kernels:boom
refuse = site_kernels:refuse
odd_result = site_kernels:odd_result
shadow = site_kernels:shadow
not_a_kernel = site_kernels:not_a_kernel
missing = site_kernels_missing:nothing
"""


@pytest.fixture
def plugin_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "site_kernels.py").write_text(textwrap.dedent(PLUGIN))
    info = tmp_path / "site_kernels-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: site-kernels\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return tmp_path


def test_plugins_load_and_broken_ones_are_skipped(
    plugin_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.syspath_prepend(str(plugin_dir))
    with caplog.at_level(logging.WARNING, logger="lanehost.kernels"):
        kernels = load_kernels()
    assert set(kernels) == set(BUILTIN_KERNELS) | {"scale", "boom", "refuse", "odd_result"}
    assert kernels["fill"] is BUILTIN_KERNELS["fill"]  # a plugin cannot replace a built-in
    logged = caplog.text
    for name in ("missing", "not_a_kernel", "shadow"):
        assert f"kernel plugin {name}" in logged


def test_without_plugins_only_the_builtins_load() -> None:
    assert set(load_kernels("litegraph.kernels.none")) == {
        "noop",
        "fill",
        "copy",
        "axpy",
        "matmul",
        "sum",
    }


async def test_the_host_runs_plugin_kernels_and_contains_their_failures(
    plugin_dir: pathlib.Path,
) -> None:
    lane = LaneHost("lane_test", 1 << 16, backend="numpy", env={"PYTHONPATH": str(plugin_dir)})
    async with lane:
        assert {"scale", "boom"} <= set(lane.hello.kernels)
        await lane.alloc("x", "int32", (4,))
        await lane.run("fill", {"value": 3}, {"out": "x"})
        assert await lane.run("scale", {"by": 2}, {"x": "x"}) == {"scaled": 4}
        assert await lane.read("x", 0, 16) == b"\x06\x00\x00\x00" * 4
        for kernel, code in [
            ("boom", "kernel_failed"),
            ("refuse", "shape_mismatch"),
            ("odd_result", "kernel_failed"),
        ]:
            with pytest.raises(LaneHostError) as caught:
                await lane.run(kernel)
            assert caught.value.code == code
        assert (await lane.stats()).used == 16  # still in service
