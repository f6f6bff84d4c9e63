"""The simulated backend: CPU, RAM, GPUs, MIG instances and a fault timeline from TOML.

Time is `trio.current_time()` relative to when the source was created, so a
timeline runs deterministically under `trio.testing.MockClock`. Faults apply
in order of `at`. XIDs are events (delivered once, by the next probe); lost,
over-temperature and read errors are conditions that hold until `recovered`.
`reset` is a GPU reset: the conditions clear, the volatile ECC count returns
to 0, and the next probe reports the reset (which is what clears a fatal XID).
"""

from __future__ import annotations

import enum
import re
from pathlib import Path

import msgspec
import trio

from node.machine.inventory import (
    CpuInfo,
    GpuDevice,
    Inventory,
    MemoryInfo,
    MigInstance,
    Probe,
    ProbeStatus,
)

__all__ = [
    "BUILTIN_SIM_FILE",
    "FaultKind",
    "SimDeviceSource",
    "SimError",
    "SimSpec",
    "discover_sim",
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


class _Spec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class SimCpu(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    logical_cores: int = 16
    physical_cores: int | None = None
    model: str = "LiteGraph simulated CPU"
    numa_nodes: int | None = 1


class SimMemory(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    total: int | str
    available: int | str | None = None


class SimMig(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    uuid: str
    name: str
    memory: int | str


class SimGpu(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    uuid: str
    name: str
    memory: int | str
    pci_bus_id: str | None = None
    compute_capability: str | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    mig_enabled: bool = False
    mig: tuple[SimMig, ...] = ()


class SimFault(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    at: float
    gpu: str
    kind: FaultKind
    xid: int | None = None
    ecc_errors: int = 1
    temperature_c: float | None = None


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
    uuids = [g.uuid for g in spec.gpus] + [m.uuid for g in spec.gpus for m in g.mig]
    if len(set(uuids)) != len(uuids):
        raise SimError(f"duplicate device uuid in {source}")
    for fault in spec.faults:
        if fault.gpu not in uuids:
            raise SimError(f"fault at {fault.at}s names unknown gpu {fault.gpu!r}")
        if fault.kind is FaultKind.XID and fault.xid is None:
            raise SimError(f"xid fault at {fault.at}s has no xid code")
    for gpu in spec.gpus:
        if gpu.mig and not gpu.mig_enabled:
            raise SimError(f"gpu {gpu.uuid} lists MIG instances but mig_enabled is false")
    return spec


class _GpuState:
    def __init__(self, temperature_c: float | None) -> None:
        self.base_temperature = temperature_c
        self.temperature = temperature_c
        self.lost = False
        self.read_error = False
        self.over_temperature = False
        self.ecc = 0
        self.xids: list[int] = []
        self.reset = False


class SimDeviceSource:
    """Replays the timeline against `trio.current_time()`; a DeviceSource."""

    def __init__(self, spec: SimSpec, *, start: float) -> None:
        self._spec = spec
        self._start = start
        self._faults = sorted(spec.faults, key=lambda f: f.at)
        self._next = 0
        self._gpus = {g.uuid: _GpuState(g.temperature_c) for g in spec.gpus}
        self._power = {g.uuid: g.power_w for g in spec.gpus}

    def _advance(self) -> None:
        elapsed = trio.current_time() - self._start
        while self._next < len(self._faults) and self._faults[self._next].at <= elapsed:
            self._apply(self._faults[self._next])
            self._next += 1

    def _apply(self, fault: SimFault) -> None:
        state = self._gpus[fault.gpu]
        match fault.kind:
            case FaultKind.XID:
                state.xids.append(fault.xid or 0)
            case FaultKind.ECC:
                state.ecc += fault.ecc_errors
            case FaultKind.OVER_TEMPERATURE:
                state.over_temperature = True
                state.temperature = fault.temperature_c or 95.0
            case FaultKind.READ_ERROR:
                state.read_error = True
            case FaultKind.LOST:
                state.lost = True
            case FaultKind.RECOVERED:
                self._clear(state)
            case FaultKind.RESET:
                self._clear(state)
                state.ecc = 0
                state.reset = True

    @staticmethod
    def _clear(state: _GpuState) -> None:
        state.lost = state.read_error = state.over_temperature = False
        state.temperature = state.base_temperature
        state.xids.clear()

    def _probe_one(self, uuid: str) -> Probe:
        state = self._gpus[uuid]
        if state.lost:
            return Probe(
                device_id=uuid, status=ProbeStatus.LOST, error="simulated: fell off the bus"
            )
        if state.read_error:
            return Probe(device_id=uuid, status=ProbeStatus.FAILED, error="simulated read error")
        xids, state.xids = tuple(state.xids), []
        reset, state.reset = state.reset, False
        return Probe(
            device_id=uuid,
            status=ProbeStatus.OK,
            xids=xids,
            temperature_c=state.temperature,
            power_w=self._power[uuid],
            ecc_volatile_uncorrected=state.ecc,
            retired_pages_pending=False,
            remapped_rows_pending=False,
            over_temperature=state.over_temperature,
            reset=reset,
        )

    async def probe(self) -> list[Probe]:
        await trio.lowlevel.checkpoint()
        self._advance()
        return [self._probe_one(uuid) for uuid in self._gpus]

    async def rediscover(self) -> set[str]:
        await trio.lowlevel.checkpoint()
        self._advance()
        return {uuid for uuid, state in self._gpus.items() if not state.lost}

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


def _gpu(spec: SimGpu, index: int) -> GpuDevice:
    total = parse_size(spec.memory)
    return GpuDevice(
        uuid=spec.uuid,
        name=spec.name,
        pci_bus_id=spec.pci_bus_id,
        memory_total_bytes=total,
        memory_used_bytes=0,
        memory_free_bytes=total,
        compute_capability=spec.compute_capability,
        mig_enabled=spec.mig_enabled,
        mig_instances=tuple(
            MigInstance(uuid=m.uuid, name=m.name, memory_total_bytes=parse_size(m.memory))
            for m in spec.mig
        ),
        minor_number=index,
    )


async def discover_sim(spec: SimSpec, *, host: tuple[CpuInfo, MemoryInfo]) -> Inventory:
    """An Inventory from the spec; CPU/RAM sections it omits come from `host`."""
    cpu, memory = host
    if spec.cpu is not None:
        c = spec.cpu
        cpu = CpuInfo(
            logical_cores=c.logical_cores,
            physical_cores=c.physical_cores,
            model=c.model,
            numa_nodes=c.numa_nodes,
            capacity_millis=c.logical_cores * 1000,
        )
    if spec.memory is not None:
        total = parse_size(spec.memory.total)
        avail = parse_size(spec.memory.available) if spec.memory.available is not None else total
        memory = MemoryInfo(
            total_bytes=total, available_bytes=min(avail, total), capacity_bytes=total
        )
    source = SimDeviceSource(spec, start=trio.current_time())
    probes = await source.probe()
    return Inventory(
        backend="sim",
        cpu=cpu,
        memory=memory,
        gpus=tuple(_gpu(g, index) for index, g in enumerate(spec.gpus)),
        driver_version=spec.driver_version,
        cuda_version=spec.cuda_version,
        probes=tuple(probes),
        source=source,
    )
