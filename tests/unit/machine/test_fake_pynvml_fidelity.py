"""The fake NVML module cannot drift from the real one (nvidia-ml-py's `pynvml`).

Every NVML name the product uses (collected from its source, so a new call is
checked the day it is written) exists in the real module and in the
fake; the fake's functions take the real ones' parameters; its constants are
the real values and its exceptions the real classes, built as the real module
builds them (driver text for `str()`, unhashable, equal by code).
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import re
from collections.abc import Callable
from typing import Any

import pynvml
import pytest

from tests.fakes.fake_pynvml import FakeGpu, FakeNvml, gpu_and_mig, nvml_error

ROOT = pathlib.Path(__file__).resolve().parents[3]
# The product's packages (pyproject's); NVML is called from machine/ and lanehost/.
PACKAGES = ("lanehost", "capabilities", "machine", "supervisor", "api", "node")
NVML_NAME = re.compile(r"^(nvml[A-Z]|NVML_|NVMLError)")


def _product_names() -> set[str]:
    """`x.nvmlFoo`, `x.NVML_BAR`, `x.NVMLError_Baz` and the like anywhere in the product."""
    names = set()
    for package in PACKAGES:
        for source in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(source.read_text(), str(source))):
                if isinstance(node, ast.Attribute) and NVML_NAME.match(node.attr):
                    names.add(node.attr)
    return names


PRODUCT = _product_names()
FAKE_FUNCTIONS = sorted(name for name in vars(FakeNvml) if name.startswith("nvml"))


def _parameters(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_scan_finds_what_the_product_calls() -> None:
    assert {"nvmlInit", "nvmlEventSetWait_v2", "NVMLError_GpuIsLost"} <= PRODUCT
    assert {"nvmlDeviceGetMemoryInfo", "NVML_CLOCK_SM", "nvmlMemory_v2"} <= PRODUCT


@pytest.mark.parametrize("name", sorted(PRODUCT))
def test_every_name_the_product_uses_is_real_and_faked(name: str) -> None:
    assert hasattr(pynvml, name), f"the product uses {name}, which pynvml does not have"
    real = getattr(pynvml, name)
    fake = FakeNvml([])
    if inspect.isfunction(real):
        assert name in vars(FakeNvml), f"the fake lacks {name}"
    elif isinstance(real, type):
        assert getattr(fake, name) is real  # the real exception class itself
    else:
        assert getattr(fake, name) == real


@pytest.mark.parametrize("name", FAKE_FUNCTIONS)
def test_the_fakes_functions_take_the_real_parameters(name: str) -> None:
    real = getattr(pynvml, name, None)
    assert inspect.isfunction(real), f"the fake has {name}, which pynvml does not"
    fake = getattr(FakeNvml([]), name)
    assert _parameters(fake) == _parameters(real), name


def test_the_fakes_errors_are_the_real_modules() -> None:
    fake = gpu_and_mig()
    fake.gpus[1].mig_memory_refused = True
    fake.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NoPermission) as refused:
        fake.nvmlDeviceGetMemoryInfo(fake.gpus[1])
    error = refused.value
    assert type(error) is pynvml.NVMLError_NoPermission
    assert (
        str(error) == "Insufficient Permissions" and error.value == pynvml.NVML_ERROR_NO_PERMISSION
    )
    assert error == pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(TypeError):
        hash(error)
    fake.gpus[0].lost = True
    with pytest.raises(pynvml.NVMLError_GpuIsLost) as lost:
        fake.nvmlDeviceGetTemperature(fake.gpus[0], pynvml.NVML_TEMPERATURE_GPU)
    assert str(lost.value) == "GPU is lost"
    # Any code, per call: the subclass the real module maps it to.
    fake.gpus[0].lost = False
    fake.gpus[0].errors["nvmlDeviceGetPowerUsage"] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        fake.nvmlDeviceGetPowerUsage(fake.gpus[0])
    assert type(nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)) is pynvml.NVMLError_InvalidArgument


def test_init_and_shutdown_are_reference_counted() -> None:
    fake = FakeNvml([FakeGpu(uuid="GPU-a")])
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    fake.nvmlInit()  # a second user in the process (a test's own CUDA probe)
    fake.nvmlShutdown()
    assert fake.nvmlDeviceGetCount() == 1  # still open for the other
    fake.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


def test_mig_answers_as_the_driver_does() -> None:
    fake = gpu_and_mig()
    fake.nvmlInit()
    b = fake.gpus[1]
    mig = fake.nvmlDeviceGetMigDeviceHandleByIndex(b, 0)
    assert fake.nvmlDeviceGetName(mig) == "NVIDIA Fake A100 40GB MIG 3g.20gb"
    assert fake.nvmlDeviceGetMigMode(b) == [1, 1]  # a list, as pynvml returns
    for handle in (b, mig):  # no utilization for the MIG parent nor the instance
        with pytest.raises(pynvml.NVMLError_NotSupported):
            fake.nvmlDeviceGetUtilizationRates(handle)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetPowerUsage(mig)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetTemperature(mig, pynvml.NVML_TEMPERATURE_GPU)
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetMigDeviceHandleByIndex(b, 5)  # an empty slot
    assert fake.nvmlDeviceGetGpuInstanceId(mig) == 2
    assert fake.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig) is b
    assert fake.nvmlDeviceIsMigDeviceHandle(mig) == 1 and fake.nvmlDeviceIsMigDeviceHandle(b) == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetRetiredPagesPendingStatus(fake.gpus[0])  # Ampere and later


def test_memory_info_v1_and_v2() -> None:
    gib = 1 << 30
    gpu = FakeGpu(uuid="GPU-a", memory_total=80 * gib, memory_used=gib, memory_reserved=gib // 2)
    fake = FakeNvml([gpu])
    fake.nvmlInit()
    v1 = fake.nvmlDeviceGetMemoryInfo(gpu)
    assert isinstance(v1, pynvml.c_nvmlMemory_t)
    assert (v1.total, v1.used, v1.free) == (80 * gib, gib + gib // 2, 80 * gib - gib - gib // 2)
    v2 = fake.nvmlDeviceGetMemoryInfo(gpu, version=pynvml.nvmlMemory_v2)
    assert isinstance(v2, pynvml.c_nvmlMemory_v2_t)
    assert (v2.total, v2.reserved, v2.used, v2.free) == (80 * gib, gib // 2, gib, v1.free)
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        fake.nvmlDeviceGetMemoryInfo(gpu, version=1)


def test_sensor_arguments_outside_the_real_constants_are_refused() -> None:
    fake = FakeNvml([FakeGpu(uuid="GPU-a")])
    fake.nvmlInit()
    gpu = fake.gpus[0]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetTemperature(gpu, 7)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetClockInfo(gpu, 9)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetTotalEccErrors(gpu, 2, pynvml.NVML_VOLATILE_ECC)


def test_events_per_set_with_instance_ids_and_wait_faults() -> None:
    fake = gpu_and_mig()
    fake.nvmlInit()
    b = fake.gpus[1]
    event_set = fake.nvmlEventSetCreate()
    fake.nvmlDeviceRegisterEvents(b, pynvml.nvmlEventTypeXidCriticalError, event_set)
    assert fake.push_xid("GPU-a", 13) == 0  # not registered: lost, as on hardware
    assert fake.push_xid("GPU-b", 79) == 1
    assert fake.push_xid("MIG-b2", 94) == 1
    fake.push_xid("GPU-b", 48)
    whole = fake.nvmlEventSetWait_v2(event_set, 0)
    assert (whole.eventData, whole.gpuInstanceId, whole.computeInstanceId) == (
        79,
        0xFFFFFFFF,
        0xFFFFFFFF,
    )
    fake.fail_wait(pynvml.NVML_ERROR_UNKNOWN, after=1)
    instance = fake.nvmlEventSetWait_v2(event_set, 0)
    assert (instance.eventData, instance.gpuInstanceId, instance.computeInstanceId) == (94, 9, 0)
    with pytest.raises(pynvml.NVMLError_Unknown):  # mid-drain: one event still queued
        fake.nvmlEventSetWait_v2(event_set, 0)
    assert fake.nvmlEventSetWait_v2(event_set, 0).eventData == 48
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(event_set, 0)
    fake.reset_gpu("GPU-b")  # a reset drops the registration
    assert fake.push_xid("GPU-b", 79) == 0


def test_energy_pcie_replays_and_remapped_rows_are_the_gpus_alone() -> None:
    fake = gpu_and_mig()
    fake.nvmlInit()
    a, b = fake.gpus
    a.energy_mj, a.pcie_replays, a.remapped_rows = 9_000, 4, (2, 1, 0, 0)
    assert fake.nvmlDeviceGetTotalEnergyConsumption(a) == 9_000  # millijoules, an int
    assert fake.nvmlDeviceGetPcieReplayCounter(a) == 4
    assert fake.nvmlDeviceGetRemappedRows(a) == (2, 1, 0, 0)  # a tuple of four, as pynvml
    mig = fake.nvmlDeviceGetMigDeviceHandleByIndex(b, 0)
    for call in (
        fake.nvmlDeviceGetTotalEnergyConsumption,
        fake.nvmlDeviceGetPcieReplayCounter,
        fake.nvmlDeviceGetRemappedRows,
    ):
        assert call(b) is not None  # the GPU in MIG mode answers for itself
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(mig)  # an instance's handle does not have them
    a.unsupported.add("nvmlDeviceGetTotalEnergyConsumption")  # before Volta
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetTotalEnergyConsumption(a)
