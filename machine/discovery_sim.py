"""The simulated backend: CPU, RAM, GPUs, MIG instances and a fault timeline from TOML.

Time is `trio.current_time()` relative to when the source was created, so a
timeline runs deterministically under `trio.testing.MockClock`. Faults apply
in order of `at`. XIDs are events (delivered once, by the next probe); lost,
over-temperature and read errors are conditions that hold until `recovered`.
`reset` is a GPU reset: the conditions clear, the volatile ECC count returns
to 0, and the next probe reports the reset (which is what clears a fatal XID).
`load` sets a GPU's or MIG instance's utilization, memory used, power or
clocks from then on. Host memory available follows `[[memory.timeline]]`.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from pathlib import Path

import msgspec
import trio

from machine.inventory import (
    CpuInfo,
    GpuDevice,
    Inventory,
    MemoryInfo,
    MigInstance,
    MigReading,
    Probe,
    ProbeStatus,
)

__all__ = [
    "BUILTIN_SIM_FILE",
    "FaultKind",
    "SimDeviceSource",
    "SimError",
    "SimHostMemory",
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


class _Load:
    """The readings a `load` event moves, for a GPU or a MIG instance."""

    def __init__(
        self, total: int, used: int, utilization: tuple[float | None, float | None]
    ) -> None:
        self.total = total
        self.used = used
        self.utilization_gpu, self.utilization_memory = utilization
        self.power: float | None = None
        self.sm_clock: int | None = None
        self.mem_clock: int | None = None

    def apply(self, fault: SimFault) -> None:
        if fault.memory_used is not None:
            self.used = parse_size(fault.memory_used)
        if fault.utilization_gpu is not None:
            self.utilization_gpu = fault.utilization_gpu
        if fault.utilization_memory is not None:
            self.utilization_memory = fault.utilization_memory
        if fault.power_w is not None:
            self.power = fault.power_w
        if fault.sm_clock_mhz is not None:
            self.sm_clock = fault.sm_clock_mhz
        if fault.memory_clock_mhz is not None:
            self.mem_clock = fault.memory_clock_mhz

    def mig_reading(self, uuid: str) -> MigReading:
        return MigReading(
            uuid=uuid,
            memory_used_bytes=self.used,
            memory_free_bytes=self.total - self.used,
            utilization_gpu_percent=self.utilization_gpu,
            utilization_memory_percent=self.utilization_memory,
        )


class _GpuState:
    def __init__(self, spec: SimGpu) -> None:
        self.base_temperature = spec.temperature_c
        self.temperature = spec.temperature_c
        self.lost = False
        self.read_error = False
        self.over_temperature = False
        self.ecc = 0
        # Aggregate (persistent) ECC counts survive a reset.
        self.ecc_aggregate = 0
        self.xids: list[int] = []
        self.xid_count = 0
        self.last_xid = 0
        self.reset = False
        self.load = _Load(
            parse_size(spec.memory),
            parse_size(spec.memory_used),
            (spec.utilization_gpu, spec.utilization_memory),
        )
        self.load.power = spec.power_w
        self.load.sm_clock = spec.sm_clock_mhz
        self.load.mem_clock = spec.memory_clock_mhz
        # MIG instances report memory; utilization only once a `load` event sets it.
        self.migs = {
            m.uuid: _Load(parse_size(m.memory), parse_size(m.memory_used), (None, None))
            for m in spec.mig
        }


class SimDeviceSource:
    """Replays the timeline against `trio.current_time()`; a DeviceSource."""

    def __init__(self, spec: SimSpec, *, start: float) -> None:
        self._spec = spec
        self._start = start
        self._faults = sorted(spec.faults, key=lambda f: f.at)
        self._next = 0
        self._gpus = {g.uuid: _GpuState(g) for g in spec.gpus}
        self._migs = {m: state.migs[m] for state in self._gpus.values() for m in state.migs}

    def _advance(self) -> None:
        elapsed = trio.current_time() - self._start
        while self._next < len(self._faults) and self._faults[self._next].at <= elapsed:
            self._apply(self._faults[self._next])
            self._next += 1

    def _apply(self, fault: SimFault) -> None:
        if fault.gpu in self._migs:
            self._migs[fault.gpu].apply(fault)  # only `load` names a MIG instance
            return
        state = self._gpus[fault.gpu]
        match fault.kind:
            case FaultKind.LOAD:
                state.load.apply(fault)
            case FaultKind.XID:
                state.xids.append(fault.xid or 0)
                state.xid_count += 1
                state.last_xid = fault.xid or 0
            case FaultKind.ECC:
                state.ecc += fault.ecc_errors
                state.ecc_aggregate += fault.ecc_errors
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
        load = state.load
        return Probe(
            device_id=uuid,
            status=ProbeStatus.OK,
            xids=xids,
            temperature_c=state.temperature,
            power_w=load.power,
            ecc_volatile_uncorrected=state.ecc,
            retired_pages_pending=False,
            remapped_rows_pending=False,
            memory_used_bytes=load.used,
            memory_free_bytes=load.total - load.used,
            utilization_gpu_percent=load.utilization_gpu,
            utilization_memory_percent=load.utilization_memory,
            sm_clock_mhz=load.sm_clock,
            memory_clock_mhz=load.mem_clock,
            ecc_volatile_corrected=0,
            ecc_aggregate_corrected=0,
            ecc_aggregate_uncorrected=state.ecc_aggregate,
            xid_count=state.xid_count,
            last_xid=state.last_xid,
            mig=tuple(mig.mig_reading(m) for m, mig in state.migs.items()),
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


class SimHostMemory:
    """Host memory from the sim file: `available`, then each timeline point once due."""

    def __init__(
        self, memory: MemoryInfo, timeline: tuple[SimMemoryPoint, ...], *, start: float
    ) -> None:
        self._memory = memory
        self._timeline = sorted(timeline, key=lambda p: p.at)
        self._start = start

    def __call__(self) -> MemoryInfo:
        elapsed = trio.current_time() - self._start
        available = self._memory.available_bytes
        for point in self._timeline:
            if point.at > elapsed:
                break
            available = min(parse_size(point.available), self._memory.total_bytes)
        return msgspec.structs.replace(self._memory, available_bytes=available)


def _gpu(spec: SimGpu, index: int) -> GpuDevice:
    total, used = parse_size(spec.memory), parse_size(spec.memory_used)
    return GpuDevice(
        uuid=spec.uuid,
        name=spec.name,
        pci_bus_id=spec.pci_bus_id,
        memory_total_bytes=total,
        memory_used_bytes=used,
        memory_free_bytes=total - used,
        compute_capability=spec.compute_capability,
        mig_enabled=spec.mig_enabled,
        mig_instances=tuple(
            MigInstance(
                uuid=m.uuid,
                name=m.name,
                memory_total_bytes=parse_size(m.memory),
                memory_used_bytes=parse_size(m.memory_used),
                gpu_instance_id=m.gpu_instance_id,
            )
            for m in spec.mig
        ),
        minor_number=index,
    )


async def discover_sim(
    spec: SimSpec,
    *,
    host: tuple[CpuInfo, MemoryInfo],
    host_memory: Callable[[], MemoryInfo] | None = None,
) -> Inventory:
    """An Inventory from the spec; CPU/RAM sections it omits come from `host` (and are
    read again through `host_memory`)."""
    cpu, memory = host
    start = trio.current_time()
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
        host_memory = SimHostMemory(memory, spec.memory.timeline, start=start)
        memory = host_memory()
    source = SimDeviceSource(spec, start=start)
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
        host_memory=host_memory,
    )
