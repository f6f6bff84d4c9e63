"""The simulated devices and host memory over time: the sim file's timeline, replayed.

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

import msgspec
import trio

from machine.inventory import MemoryInfo, MigReading, Probe, ProbeStatus
from machine.sim_spec import FaultKind, SimFault, SimGpu, SimMemoryPoint, SimSpec, parse_size

__all__ = ["SimDeviceSource", "SimHostMemory"]


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
            remapped_rows_failed=False,
            remapped_rows_correctable=0,
            remapped_rows_uncorrectable=0,
            memory_used_bytes=load.used,
            memory_free_bytes=load.total - load.used,
            utilization_gpu_percent=load.utilization_gpu,
            utilization_memory_percent=load.utilization_memory,
            sm_clock_mhz=load.sm_clock,
            memory_clock_mhz=load.mem_clock,
            ecc_volatile_corrected=0,
            ecc_aggregate_corrected=0,
            ecc_aggregate_uncorrected=state.ecc_aggregate,
            pcie_replay_count=0,
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
