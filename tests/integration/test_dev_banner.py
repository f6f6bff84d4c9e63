"""`dev` says, in its start-up banner, when its devices are simulated and why: here where
NVML fails, each with a pynvml of its own; `--devices sim` asked for on purpose is
tests/integration/test_cli_client.py's, on its shared daemon."""

from __future__ import annotations

import pathlib
import signal

import pytest

from tests.helpers import (
    ROOT,
    clean_env,
    node_command,
    rest_of_stderr,
    spawned,
    stop,
    wait_for_line,
)

# A pynvml that imports but cannot initialise, as on a host whose driver is broken.
BROKEN_NVML = """
class NVMLError(Exception):
    pass


def nvmlInit():
    raise NVMLError("Driver Not Loaded")


def nvmlShutdown():
    pass
"""
MISSING_NVML = 'raise ImportError("libnvidia-ml.so.1: cannot open shared object file")\n'


@pytest.mark.parametrize(
    ("module", "why"),
    [
        (BROKEN_NVML, "NVMLError: Driver Not Loaded"),
        (MISSING_NVML, "libnvidia-ml.so.1: cannot open shared object file"),
    ],
    ids=["broken", "missing"],
)
def test_dev_says_its_devices_are_simulated_and_why(
    tmp_path: pathlib.Path, module: str, why: str
) -> None:
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "pynvml.py").write_text(module)
    env = clean_env(LITEGRAPH_NODE_STATE_DIR=str(tmp_path / "state"), PYTHONPATH=f"{fake}:{ROOT}")
    with spawned(node_command("dev", "--listen", "127.0.0.1:0"), env) as proc:
        line = wait_for_line(proc, r"(  devices: .*)")
        assert "SIMULATED" in line and "not real hardware" in line, line
        assert why in line, line
        assert stop(proc, signal.SIGINT) == 0
        rest_of_stderr(proc)
