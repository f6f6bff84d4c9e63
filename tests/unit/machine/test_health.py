"""Health state machine: the table, hysteresis, XID classes, lost devices, events."""

from __future__ import annotations

import pytest

from machine.health import (
    ALLOCATABLE_STATES,
    DEFAULT_FATAL_XIDS,
    TRANSITIONS,
    HealthState,
    HealthTracker,
    HealthTransition,
    Signal,
)
from machine.inventory import Probe, ProbeStatus

GPU = "GPU-aaaa"


def ok(**kw: object) -> Probe:
    return Probe(device_id=GPU, status=ProbeStatus.OK, **kw)  # type: ignore[arg-type]


def tracker(events: list[HealthTransition], probes: int = 3) -> HealthTracker:
    t = HealthTracker(recovery_probes=probes, on_transition=events.append)
    t.register(GPU)
    return t


def test_table_is_complete() -> None:
    for state in HealthState:
        for signal in Signal:
            assert (state, signal) in TRANSITIONS


def test_default_fatal_xids() -> None:
    assert frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120}) == DEFAULT_FATAL_XIDS
    assert HealthState.SUSPECT in ALLOCATABLE_STATES
    assert HealthState.UNKNOWN not in ALLOCATABLE_STATES


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68])
def test_application_xid_makes_suspect_at_most(xid: int) -> None:
    events: list[HealthTransition] = []
    t = tracker(events)
    t.observe(ok(xids=(xid,)), at=1.0)
    t.observe(ok(xids=(xid, xid)), at=2.0)
    assert t.state(GPU) is HealthState.SUSPECT
    assert [e.to_state for e in events] == [HealthState.SUSPECT]


@pytest.mark.parametrize("xid", sorted(DEFAULT_FATAL_XIDS))
def test_fatal_xid_makes_unhealthy(xid: int) -> None:
    events: list[HealthTransition] = []
    t = tracker(events)
    t.observe(ok(xids=(xid,)), at=1.0)
    assert t.state(GPU) is HealthState.UNHEALTHY
    assert events[0].reasons == (f"xid_{xid}: critical device error, needs a reset",)
    assert events[0].signal is Signal.FATAL_XID


def test_fatal_set_is_configurable() -> None:
    t = HealthTracker(fatal_xids={13})
    t.register(GPU)
    t.observe(ok(xids=(79,)), at=0)
    assert t.state(GPU) is HealthState.SUSPECT
    t.observe(ok(xids=(13,)), at=0)
    assert t.state(GPU) is HealthState.UNHEALTHY


def test_recovery_needs_consecutive_good_probes() -> None:
    events: list[HealthTransition] = []
    t = tracker(events, probes=3)
    t.observe(ok(over_temperature=True, temperature_c=97.0), at=0)
    t.observe(ok(), at=1)
    t.observe(ok(), at=2)
    # A flapping reading resets the streak without changing the state.
    t.observe(Probe(device_id=GPU, status=ProbeStatus.FAILED, error="x"), at=3)
    assert t.state(GPU) is HealthState.UNHEALTHY
    t.observe(ok(), at=4)
    t.observe(ok(), at=5)
    assert t.state(GPU) is HealthState.UNHEALTHY
    t.observe(ok(), at=6)
    assert t.state(GPU) is HealthState.HEALTHY
    assert [(e.from_state, e.to_state) for e in events] == [
        (HealthState.HEALTHY, HealthState.UNHEALTHY),
        (HealthState.UNHEALTHY, HealthState.HEALTHY),
    ]
    assert events[-1].at == 6
    assert t.health(GPU).reasons == ()


def test_failed_reading_is_unknown_never_healthy() -> None:
    t = tracker([])
    t.observe(Probe(device_id=GPU, status=ProbeStatus.FAILED, error="timeout"), at=0)
    assert t.state(GPU) is HealthState.UNKNOWN
    assert t.health(GPU).reasons == ("read_failed: timeout",)
    assert HealthTracker().state("never-registered") is HealthState.UNKNOWN


def test_lost_needs_rediscovery_then_good_probes() -> None:
    events: list[HealthTransition] = []
    t = tracker(events, probes=2)
    t.observe(Probe(device_id=GPU, status=ProbeStatus.LOST, error="off the bus"), at=0)
    assert t.state(GPU) is HealthState.LOST
    for i in range(5):
        t.observe(ok(), at=1 + i)
    assert t.state(GPU) is HealthState.LOST
    t.rediscovered(GPU, at=10)
    assert t.state(GPU) is HealthState.UNKNOWN
    t.observe(ok(), at=11)
    t.observe(ok(), at=12)
    assert t.state(GPU) is HealthState.HEALTHY
    assert [e.to_state for e in events] == [
        HealthState.LOST,
        HealthState.UNKNOWN,
        HealthState.HEALTHY,
    ]


def test_ecc_increase_and_pending_pages() -> None:
    t = tracker([])
    t.observe(ok(ecc_volatile_uncorrected=2), at=0)  # a baseline, not an increase
    assert t.state(GPU) is HealthState.HEALTHY
    t.observe(ok(ecc_volatile_uncorrected=3), at=1)
    assert t.state(GPU) is HealthState.UNHEALTHY
    t2 = tracker([])
    t2.observe(ok(remapped_rows_pending=True), at=0)
    assert t2.state(GPU) is HealthState.UNHEALTHY
    t3 = tracker([])
    t3.observe(ok(over_temperature=True, temperature_c=99.0), at=0)
    assert t3.health(GPU).reasons == ("over_temperature: 99.0 C",)


def test_reasons_are_bounded() -> None:
    t = tracker([])
    for xid in range(200, 220):
        t.observe(ok(xids=(xid,)), at=0)
    assert len(t.health(GPU).reasons) <= 8


def test_recovery_probes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="recovery_probes"):
        HealthTracker(recovery_probes=0)


@pytest.mark.parametrize("xid", sorted(DEFAULT_FATAL_XIDS))
def test_a_fatal_xid_stays_unhealthy_through_good_probes_until_a_reset(xid: int) -> None:
    events: list[HealthTransition] = []
    t = tracker(events, probes=3)
    t.observe(ok(xids=(xid,)), at=0)
    for i in range(10):
        t.observe(ok(), at=1 + i)
    assert t.state(GPU) is HealthState.UNHEALTHY
    assert t.health(GPU).reasons == (f"xid_{xid}: critical device error, needs a reset",)
    # The reset reading is itself good: the first of the probes recovery needs.
    t.observe(ok(reset=True), at=20)
    assert t.state(GPU) is HealthState.UNKNOWN
    assert t.health(GPU).reasons == ("reset: the device was reset",)
    t.observe(ok(), at=21)
    assert t.state(GPU) is HealthState.UNKNOWN
    t.observe(ok(), at=22)
    assert t.state(GPU) is HealthState.HEALTHY
    assert [(e.to_state, e.signal) for e in events] == [
        (HealthState.UNHEALTHY, Signal.FATAL_XID),
        (HealthState.UNKNOWN, Signal.RESET),
        (HealthState.HEALTHY, Signal.GOOD),
    ]


def test_a_fatal_xid_outlasts_other_faults_clearing() -> None:
    t = tracker([], probes=1)
    t.observe(ok(xids=(79,), over_temperature=True, temperature_c=97.0), at=0)
    t.observe(Probe(device_id=GPU, status=ProbeStatus.FAILED, error="x"), at=1)
    for i in range(5):
        t.observe(ok(), at=2 + i)
    assert t.state(GPU) is HealthState.UNHEALTHY
    # An application XID after a fatal one does not make the device any better.
    t.observe(ok(xids=(13,)), at=8)
    assert t.state(GPU) is HealthState.UNHEALTHY


def test_a_volatile_ecc_count_going_down_is_a_reset() -> None:
    # NVML clears the volatile ECC counters when the GPU is reset.
    t = tracker([], probes=1)
    t.observe(ok(ecc_volatile_uncorrected=4), at=0)
    t.observe(ok(ecc_volatile_uncorrected=4, xids=(48,)), at=1)
    t.observe(ok(ecc_volatile_uncorrected=4), at=2)
    assert t.state(GPU) is HealthState.UNHEALTHY
    t.observe(ok(ecc_volatile_uncorrected=0), at=3)
    assert t.state(GPU) is HealthState.HEALTHY


def test_a_lost_device_found_again_has_been_reset() -> None:
    t = tracker([], probes=1)
    t.observe(ok(xids=(79,)), at=0)
    t.observe(Probe(device_id=GPU, status=ProbeStatus.LOST, error="off the bus"), at=1)
    t.rediscovered(GPU, at=2)
    assert t.state(GPU) is HealthState.UNKNOWN
    t.observe(ok(), at=3)
    assert t.state(GPU) is HealthState.HEALTHY


def test_a_reset_does_not_hide_a_condition_that_still_holds() -> None:
    t = tracker([], probes=1)
    t.observe(ok(xids=(79,)), at=0)
    t.observe(ok(reset=True, remapped_rows_pending=True), at=1)
    assert t.state(GPU) is HealthState.UNHEALTHY
    t.observe(ok(), at=2)
    assert t.state(GPU) is HealthState.HEALTHY


def test_a_reset_of_a_healthy_device_changes_nothing() -> None:
    events: list[HealthTransition] = []
    t = tracker(events)
    t.observe(ok(reset=True), at=0)
    assert t.state(GPU) is HealthState.HEALTHY and events == []
