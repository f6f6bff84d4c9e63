"""The sim file: its TOML schema, sizes such as "24GiB", and the checks a file must pass.

A file lists the CPU, RAM, GPUs and MIG instances to simulate and a timeline of
faults and load (replayed by machine/sim_timeline.py). load_sim_spec checks it
all up front, so a bad file is a SimError at start-up, not a fault mid-replay.
"""

from __future__ import annotations

import enum
import re
from pathlib import Path

import msgspec

__all__ = [
    "BUILTIN_SIM_FILE",
    "FaultKind",
    "SimCpu",
    "SimError",
    "SimFault",
    "SimGpu",
    "SimMemory",
    "SimMemoryPoint",
    "SimMig",
    "SimSpec",
    "load_sim_spec",
    "parse_size",
]

BUILTIN_SIM_FILE = Path(__file__).with_name("sim_workstation.toml")
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$")
_UNITS = {
    None: 1,
    "B": 1,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}


class SimError(ValueError):
    """The simulation file is missing or malformed (the operator's input is at fault)."""


def parse_size(value: int | str) -> int:
    """Bytes from an int or a size string such as "24GiB"."""
    if isinstance(value, int):
        if value < 0:
            raise SimError(f"negative size: {value}")
        return value
    match = _SIZE.match(value)
    if match is None:
        raise SimError(f"not a size: {value!r}")
    return int(match.group(1)) * _UNITS[match.group(2)]


class FaultKind(enum.StrEnum):
    XID = "xid"
    ECC = "ecc"
    OVER_TEMPERATURE = "over_temperature"
    READ_ERROR = "read_error"
    LOST = "lost"
    RECOVERED = "recovered"
    RESET = "reset"
    LOAD = "load"


class _Spec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class SimCpu(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    logical_cores: int = 16
    physical_cores: int | None = None
    model: str = "LiteGraph simulated CPU"
    numa_nodes: int | None = 1


class SimMemoryPoint(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    at: float
    available: int | str


class SimMemory(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    total: int | str
    available: int | str | None = None
    # Host memory available from `at` seconds on, in order of `at`.
    timeline: tuple[SimMemoryPoint, ...] = ()


class SimMig(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    uuid: str
    name: str
    memory: int | str
    gpu_instance_id: int | None = None
    memory_used: int | str = 0


class SimGpu(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    uuid: str
    name: str
    memory: int | str
    pci_bus_id: str | None = None
    compute_capability: str | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    memory_used: int | str = 0
    utilization_gpu: float | None = 0.0
    utilization_memory: float | None = 0.0
    sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None
    mig_enabled: bool = False
    mig: tuple[SimMig, ...] = ()


class SimFault(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    at: float
    gpu: str
    kind: FaultKind
    xid: int | None = None
    ecc_errors: int = 1
    temperature_c: float | None = None
    # `load`: the readings it sets (those left out keep their value).
    utilization_gpu: float | None = None
    utilization_memory: float | None = None
    memory_used: int | str | None = None
    power_w: float | None = None
    sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None


class SimSpec(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    driver_version: str | None = "sim"
    cuda_version: str | None = None
    cpu: SimCpu | None = None
    memory: SimMemory | None = None
    gpus: tuple[SimGpu, ...] = ()
    faults: tuple[SimFault, ...] = ()


def load_sim_spec(path: Path | None = None) -> SimSpec:
    """Read and check a sim file (the built-in workstation when `path` is None)."""
    source = path or BUILTIN_SIM_FILE
    try:
        spec = msgspec.toml.decode(source.read_bytes(), type=SimSpec)
    except OSError as exc:
        raise SimError(f"cannot read sim file {source}: {exc.strerror}") from exc
    except msgspec.ValidationError as exc:
        raise SimError(f"invalid sim file {source}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise SimError(f"invalid TOML in sim file {source}: {exc}") from exc
    _check(spec, source)
    return spec


def _check(spec: SimSpec, source: Path) -> None:
    uuids = [g.uuid for g in spec.gpus] + [m.uuid for g in spec.gpus for m in g.mig]
    if len(set(uuids)) != len(uuids):
        raise SimError(f"duplicate device uuid in {source}")
    totals = {g.uuid: parse_size(g.memory) for g in spec.gpus}
    migs = {m.uuid: parse_size(m.memory) for g in spec.gpus for m in g.mig}
    for fault in spec.faults:
        if fault.gpu not in totals and fault.gpu not in migs:
            raise SimError(f"fault at {fault.at}s names unknown gpu {fault.gpu!r}")
        if fault.gpu in migs and fault.kind is not FaultKind.LOAD:
            raise SimError(f"fault at {fault.at}s: only `load` may name a MIG instance")
        if fault.kind is FaultKind.XID and fault.xid is None:
            raise SimError(f"xid fault at {fault.at}s has no xid code")
        if fault.memory_used is not None:
            _check_used(fault.memory_used, {**totals, **migs}[fault.gpu], f"load at {fault.at}s")
        for value in (fault.utilization_gpu, fault.utilization_memory):
            if value is not None and not 0 <= value <= 100:
                raise SimError(f"load at {fault.at}s: utilization {value} is not 0-100")
    for gpu in spec.gpus:
        if gpu.mig and not gpu.mig_enabled:
            raise SimError(f"gpu {gpu.uuid} lists MIG instances but mig_enabled is false")
        _check_used(gpu.memory_used, totals[gpu.uuid], f"gpu {gpu.uuid}")
        for mig in gpu.mig:
            _check_used(mig.memory_used, migs[mig.uuid], f"mig {mig.uuid}")
    if spec.memory is not None:
        for point in spec.memory.timeline:
            parse_size(point.available)


def _check_used(used: int | str, total: int, where: str) -> None:
    if parse_size(used) > total:
        raise SimError(f"{where}: memory_used is more than the device's memory")
