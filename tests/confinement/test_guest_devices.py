"""What a guest's /dev holds: only the device nodes of its grant, none for `sandbox`."""

from __future__ import annotations

import os
import pathlib
import stat

from tests.confinement.guests import confined_node, python, run_to_end
from tests.helpers import guest_run_dir

NVIDIA_NODES = {
    "nvidia0": (195, 0),
    "nvidia1": (195, 1),
    "nvidiactl": (195, 255),
    "nvidia-uvm": (510, 0),
    "nvidia-uvm-tools": (510, 1),
}
LIST_DEV = "import os; print(sorted(n for n in os.listdir('/dev') if n.startswith('nvidia')))"


def fake_dev_root() -> pathlib.Path:
    """Stand-ins for /dev/nvidia0, /dev/nvidia1 and the driver's control nodes: character
    devices with the driver's numbers (a guest's device cgroup allows them by number;
    without the driver nothing answers behind them)."""
    root = pathlib.Path(guest_run_dir())
    root.chmod(0o755)
    for name, (major, minor) in NVIDIA_NODES.items():
        os.mknod(root / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        (root / name).chmod(0o666)
    return root


def gpu_request(isolation: str) -> dict[str, object]:
    body = python(LIST_DEV, requirement="gpu", isolation=isolation)
    body["resources"] = {"cpu_millis": 500, "memory_bytes": 256 * 2**20, "gpus": 1}
    if isolation != "dedicated":
        body["resources"]["vram_bytes"] = 2**30  # type: ignore[index]
    return body


async def test_a_shared_guest_sees_only_its_own_gpu_node(tmp_path: pathlib.Path) -> None:
    async with confined_node(tmp_path, "--dev-root", str(fake_dev_root())) as node:
        found = await run_to_end(node, gpu_request("shared"))
        assert found["state"] == "succeeded", found
        machine = node.daemon.machine
        assert machine is not None
        lane = machine.ledger.lane(found["lanes"][0]["lane_id"])
        assert lane is not None
        gpu = next(g for g in machine.inventory.gpus if g.uuid == lane.device_id)
        expected = sorted(
            [f"nvidia{gpu.minor_number}", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]
        )
        assert found["stdout_tail"].strip() == str(expected)


async def test_a_sandbox_guest_sees_no_gpu_node_at_all(tmp_path: pathlib.Path) -> None:
    async with confined_node(tmp_path, "--dev-root", str(fake_dev_root())) as node:
        found = await run_to_end(node, gpu_request("sandbox"))
        assert found["state"] == "succeeded", found
        assert found["stdout_tail"].strip() == "[]"


async def test_the_hosts_gpu_nodes_never_reach_a_cpu_guest(tmp_path: pathlib.Path) -> None:
    async with confined_node(tmp_path, "--dev-root", str(fake_dev_root())) as node:
        found = await run_to_end(node, python(LIST_DEV))
        assert found["state"] == "succeeded", found
        assert found["stdout_tail"].strip() == "[]"


async def test_a_sandbox_guest_has_no_host_network(tmp_path: pathlib.Path) -> None:
    code = (
        "import socket\n"
        "print(sorted(n for _, n in socket.if_nameindex()))\n"
        "s = socket.socket()\n"
        "s.settimeout(2)\n"
        "try:\n"
        "    s.connect(('127.0.0.1', int(__import__('sys').argv[1])))\n"
        "    print('CONNECTED')\n"
        "except OSError as exc:\n"
        "    print('REFUSED', exc.errno)\n"
    )
    async with confined_node(tmp_path) as node:
        port = node.url.rsplit(":", 1)[1]
        body = python(code, isolation="sandbox")
        body["work"]["argv"].append(port)
        found = await run_to_end(node, body)
        assert found["state"] == "succeeded", found
        assert found["stdout_tail"].startswith("['lo']"), found["stdout_tail"]
        assert "CONNECTED" not in found["stdout_tail"]
