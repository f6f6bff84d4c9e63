"""Device health as a state machine kept as data (no I/O here).

States: healthy, suspect, unhealthy, unknown, lost. Inputs are `Signal`s,
classified from `Probe`s. `TRANSITIONS` is the one table of moves; a "gated"
move back to healthy happens only after `recovery_probes` consecutive good
probes (hysteresis), so a flapping reading does not flap the lane. A lost
device ignores everything but `REDISCOVERED`, which brings it to unknown, from
where it must earn its way back with good probes. A failed reading is
`unknown`, never `healthy`. Every change of state emits a `HealthTransition`.

A fatal XID is different: good probes never heal it (NVIDIA's own device
plugin keeps such a GPU unhealthy too). It holds until a reset is observed:
a probe that says so (the simulator's `reset` event), the volatile
uncorrected ECC count going down (the driver clears it when the GPU is
reset), or a lost device found again. The reset moves the device to
unknown, and good probes then bring it back as usual. Restarting the daemon
also forgets it, since a new tracker starts from fresh readings.

A MIG instance is tracked as a device of its own, registered with its GPU as
its parent. It is read with its GPU: an XID the driver attributes to the
instance (by its GPU and compute instance ids) is the instance's signal, not
the GPU's, so one instance's fatal XID takes out that instance alone; a reset
of the GPU (observed as above) resets its instances. A lane of an instance is
as healthy as the worse of its GPU and its instance (machine/ledger.py).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import msgspec

from machine.inventory import MigReading, Probe, ProbeStatus

__all__ = [
    "ALLOCATABLE_STATES",
    "APPLICATION_XIDS",
    "DEFAULT_FATAL_XIDS",
    "TRANSITIONS",
    "DeviceHealth",
    "HealthState",
    "HealthTracker",
    "HealthTransition",
    "Rule",
    "Signal",
    "classify",
    "classify_instance",
    "step",
]

DEFAULT_FATAL_XIDS: frozenset[int] = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})
# Caused by the application, not the device: at most `suspect`.
APPLICATION_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68})
# Keep reason lists short: they go on the wire with every snapshot.
MAX_REASONS = 8


class HealthState(enum.StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    UNHEALTHY = "unhealthy"
    UNKNOWN = "unknown"
    LOST = "lost"


# Suspect devices still take work; the others add nothing to allocatable.
ALLOCATABLE_STATES: frozenset[HealthState] = frozenset({HealthState.HEALTHY, HealthState.SUSPECT})


class Signal(enum.StrEnum):
    GOOD = "good"
    READ_FAILED = "read_failed"
    APP_XID = "app_xid"
    FATAL_XID = "fatal_xid"
    ECC = "ecc"
    OVER_TEMPERATURE = "over_temperature"
    LOST = "lost"
    REDISCOVERED = "rediscovered"
    RESET = "reset"


class Rule(NamedTuple):
    target: HealthState
    # True: move only after `recovery_probes` consecutive GOOD signals.
    gated: bool = False


def _table() -> dict[tuple[HealthState, Signal], Rule]:
    h, s, u, k, lost = (
        HealthState.HEALTHY,
        HealthState.SUSPECT,
        HealthState.UNHEALTHY,
        HealthState.UNKNOWN,
        HealthState.LOST,
    )
    faults = {
        Signal.FATAL_XID: Rule(u),
        Signal.ECC: Rule(u),
        Signal.OVER_TEMPERATURE: Rule(u),
        Signal.LOST: Rule(lost),
    }
    rows: dict[HealthState, dict[Signal, Rule]] = {
        h: {
            Signal.GOOD: Rule(h),
            Signal.READ_FAILED: Rule(k),
            Signal.APP_XID: Rule(s),
            Signal.REDISCOVERED: Rule(h),
            Signal.RESET: Rule(h),
            **faults,
        },
        s: {
            Signal.GOOD: Rule(h, gated=True),
            Signal.READ_FAILED: Rule(k),
            Signal.APP_XID: Rule(s),
            Signal.REDISCOVERED: Rule(s),
            Signal.RESET: Rule(s),
            **faults,
        },
        # A failed reading keeps an unhealthy device unhealthy: it says nothing good.
        u: {
            Signal.GOOD: Rule(h, gated=True),
            Signal.READ_FAILED: Rule(u),
            Signal.APP_XID: Rule(u),
            Signal.REDISCOVERED: Rule(u),
            # What the reset left is read afresh: unknown until good probes say more.
            Signal.RESET: Rule(k),
            **faults,
        },
        k: {
            Signal.GOOD: Rule(h, gated=True),
            Signal.READ_FAILED: Rule(k),
            Signal.APP_XID: Rule(k),
            Signal.REDISCOVERED: Rule(k),
            Signal.RESET: Rule(k),
            **faults,
        },
        # Only a rediscovery brings a lost device back, and then only to unknown.
        lost: {sig: Rule(k if sig is Signal.REDISCOVERED else lost) for sig in Signal},
    }
    return {(state, sig): rule for state, row in rows.items() for sig, rule in row.items()}


TRANSITIONS: Mapping[tuple[HealthState, Signal], Rule] = _table()


class DeviceHealth(msgspec.Struct, frozen=True, kw_only=True):
    state: HealthState
    reasons: tuple[str, ...] = ()
    good_streak: int = 0
    since: float = 0.0
    # A fatal XID was seen: good probes do not heal the device, only a reset does.
    needs_reset: bool = False


class HealthTransition(msgspec.Struct, frozen=True, kw_only=True):
    """One change of a device's health state (the event every transition emits)."""

    device_id: str
    from_state: HealthState
    to_state: HealthState
    signal: Signal
    reasons: tuple[str, ...]
    at: float


def step(
    current: DeviceHealth, signal: Signal, reason: str, *, recovery_probes: int, at: float
) -> DeviceHealth:
    """The pure transition function: look the move up in TRANSITIONS and apply hysteresis."""
    rule = TRANSITIONS[(current.state, signal)]
    needs_reset = _needs_reset(current, signal)
    if signal is Signal.GOOD:
        if rule.target is current.state or needs_reset:
            return current
        streak = current.good_streak + 1
        if rule.gated and streak < max(1, recovery_probes):
            return msgspec.structs.replace(current, good_streak=streak)
        return DeviceHealth(state=rule.target, reasons=(), good_streak=0, since=at)
    if rule.target is current.state:
        reasons = current.reasons
        if reason and reason not in reasons and signal is not Signal.RESET:
            reasons = (*reasons, reason)[-MAX_REASONS:]
        return msgspec.structs.replace(
            current, reasons=reasons, good_streak=0, needs_reset=needs_reset
        )
    return DeviceHealth(
        state=rule.target,
        reasons=(reason,) if reason else (),
        since=at,
        needs_reset=needs_reset,
    )


def _needs_reset(current: DeviceHealth, signal: Signal) -> bool:
    if signal is Signal.FATAL_XID:
        return True
    # A device that fell off the bus and is readable again has been reset.
    if signal is Signal.RESET or (
        signal is Signal.REDISCOVERED and current.state is HealthState.LOST
    ):
        return False
    return current.needs_reset


def classify(
    probe: Probe, *, fatal_xids: frozenset[int], previous_ecc: int | None
) -> list[tuple[Signal, str]]:
    """Turn one probe into signals with reasons; a clean reading is one GOOD signal.

    A reset comes first: the rest of the same reading describes the device after it.
    """
    if probe.status is ProbeStatus.LOST:
        return [(Signal.LOST, f"device_lost: {probe.error or 'device is gone'}")]
    if probe.status is ProbeStatus.FAILED:
        # XIDs read before the reading failed still count (a fatal one above all).
        failed = (Signal.READ_FAILED, f"read_failed: {probe.error or 'reading failed'}")
        return [failed, *_xid_signals(probe.xids, fatal_xids)]
    ecc = probe.ecc_volatile_uncorrected
    reset: list[tuple[Signal, str]] = []
    if probe.reset or (ecc is not None and previous_ecc is not None and ecc < previous_ecc):
        reset.append((Signal.RESET, "reset: the device was reset"))
    signals = _xid_signals(probe.xids, fatal_xids)
    if ecc is not None and previous_ecc is not None and ecc > previous_ecc:
        signals.append((Signal.ECC, f"ecc_uncorrected: {ecc - previous_ecc} new volatile errors"))
    if probe.retired_pages_pending:
        signals.append((Signal.ECC, "retired_pages_pending: reset needed"))
    if probe.remapped_rows_failed:
        # Permanent: a reset does not bring the rows back (the GPU needs service).
        signals.append(
            (Signal.ECC, "remapped_rows_failed: row remapping failed, GPU needs service")
        )
    elif probe.remapped_rows_pending:
        signals.append((Signal.ECC, "remapped_rows_pending: reset needed"))
    if probe.over_temperature:
        signals.append((Signal.OVER_TEMPERATURE, f"over_temperature: {probe.temperature_c} C"))
    return reset + (signals or [(Signal.GOOD, "")])


def _xid_signals(xids: Iterable[int], fatal_xids: frozenset[int]) -> list[tuple[Signal, str]]:
    return [
        (Signal.FATAL_XID, f"xid_{xid}: critical device error, needs a reset")
        if xid in fatal_xids
        else (Signal.APP_XID, f"xid_{xid}: application error")
        for xid in xids
    ]


def classify_instance(
    probe: Probe,
    reading: MigReading | None,
    gpu_signals: Iterable[tuple[Signal, str]],
    *,
    fatal_xids: frozenset[int],
) -> list[tuple[Signal, str]]:
    """A MIG instance's signals from its GPU's probe: the GPU's reset, the XIDs the
    driver named the instance in, else (on a good reading) GOOD. A GPU that is lost
    or unreadable says nothing more of the instance: its lane shows the GPU's state."""
    if probe.status is ProbeStatus.LOST:
        return []
    reset = [(sig, reason) for sig, reason in gpu_signals if sig is Signal.RESET]
    signals = _xid_signals(reading.xids if reading is not None else (), fatal_xids)
    if not signals and probe.status is ProbeStatus.OK:
        signals = [(Signal.GOOD, "")]
    return reset + signals


class HealthTracker:
    """Holds each device's DeviceHealth and feeds probes through the table.

    `on_transition` receives every HealthTransition (a list's `append` works).
    An unregistered device reads as `unknown` (fail closed).
    """

    def __init__(
        self,
        *,
        fatal_xids: Iterable[int] = DEFAULT_FATAL_XIDS,
        recovery_probes: int = 3,
        on_transition: Callable[[HealthTransition], None] | None = None,
    ) -> None:
        if recovery_probes < 1:
            raise ValueError("recovery_probes must be at least 1")
        self.fatal_xids = frozenset(fatal_xids)
        self.recovery_probes = recovery_probes
        self._on_transition = on_transition
        self._devices: dict[str, DeviceHealth] = {}
        self._ecc: dict[str, int | None] = {}
        self._last: dict[str, Probe] = {}
        # MIG instances by their GPU, and each instance's GPU.
        self._instances: dict[str, list[str]] = {}
        self._parent: dict[str, str] = {}

    def register(
        self,
        device_id: str,
        *,
        state: HealthState = HealthState.HEALTHY,
        at: float = 0.0,
        parent: str | None = None,
    ) -> None:
        """Track a device; `parent`: it is a MIG instance of that GPU, read with it."""
        self._devices[device_id] = DeviceHealth(state=state, since=at)
        self._ecc[device_id] = None
        if parent is not None and self._parent.get(device_id) != parent:
            self._parent[device_id] = parent
            self._instances.setdefault(parent, []).append(device_id)

    def devices(self) -> list[str]:
        """The devices probes are taken of (GPUs; MIG instances are read with theirs)."""
        return [d for d in self._devices if d not in self._parent]

    def health(self, device_id: str) -> DeviceHealth:
        found = self._devices.get(device_id)
        if found is None:
            return DeviceHealth(state=HealthState.UNKNOWN, reasons=("not_discovered",))
        return found

    def state(self, device_id: str) -> HealthState:
        return self.health(device_id).state

    def last_reading(self, device_id: str) -> Probe | None:
        """The latest successful probe of the device (telemetry for the snapshot)."""
        return self._last.get(device_id)

    def states(self) -> dict[str, HealthState]:
        return {device_id: h.state for device_id, h in self._devices.items()}

    def apply(
        self, device_id: str, signal: Signal, reason: str = "", *, at: float
    ) -> HealthTransition | None:
        if device_id not in self._devices:
            return None
        before = self._devices[device_id]
        after = step(before, signal, reason, recovery_probes=self.recovery_probes, at=at)
        self._devices[device_id] = after
        if after.state is before.state:
            return None
        event = HealthTransition(
            device_id=device_id,
            from_state=before.state,
            to_state=after.state,
            signal=signal,
            reasons=after.reasons,
            at=at,
        )
        if self._on_transition is not None:
            self._on_transition(event)
        return event

    def observe(self, probe: Probe, *, at: float) -> list[HealthTransition]:
        """Feed one probe; returns the transitions it caused (also sent to the callback)."""
        if probe.device_id not in self._devices:
            return []
        previous = self._ecc.get(probe.device_id)
        signals = classify(probe, fatal_xids=self.fatal_xids, previous_ecc=previous)
        if probe.status is ProbeStatus.OK:
            self._last[probe.device_id] = probe
            if probe.ecc_volatile_uncorrected is not None:
                self._ecc[probe.device_id] = probe.ecc_volatile_uncorrected
        events = self._apply_all(probe.device_id, signals, at=at)
        readings = {m.uuid: m for m in probe.mig}
        for instance in self._instances.get(probe.device_id, ()):
            found = classify_instance(
                probe, readings.get(instance), signals, fatal_xids=self.fatal_xids
            )
            events += self._apply_all(instance, found, at=at)
        return events

    def _apply_all(
        self, device_id: str, signals: Iterable[tuple[Signal, str]], *, at: float
    ) -> list[HealthTransition]:
        events = []
        for signal, reason in signals:
            event = self.apply(device_id, signal, reason, at=at)
            if event is not None:
                events.append(event)
        return events

    def rediscovered(self, device_id: str, *, at: float) -> HealthTransition | None:
        self._ecc[device_id] = None  # counters restart with the driver's view of the device
        event = self.apply(device_id, Signal.REDISCOVERED, "rediscovered", at=at)
        # A GPU that fell off the bus and is back was reset, and its instances with it.
        for instance in self._instances.get(device_id, ()):
            self.apply(instance, Signal.RESET, "reset: its GPU was found again", at=at)
        return event
