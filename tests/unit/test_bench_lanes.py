"""bench/bench_lanes.py: its rows, from figures given here (no daemon is started)."""

from __future__ import annotations

import pathlib

import pytest

from bench import bench_lanes
from bench.bench_lanes import Deadline, Measured, Revision, Samples, findings, noisy
from bench.run_all import render

MS = 1e-3


def samples(idle: float, noisy_noop: float, kernel: float) -> Samples:
    return Samples(
        idle=[idle] * 99 + [2 * idle],
        put=[2 * MS] * 10,
        get=[1 * MS] * 10,
        noisy=[noisy_noop] * 100,
        kernel=[kernel] * 20,
    )


def measured(current: Samples) -> Measured:
    base, cur = (
        Revision("baseline abc1234", pathlib.Path("/b")),
        Revision("current", pathlib.Path("/c")),
    )
    return Measured(
        baseline=base,
        current=cur,
        samples={base.label: samples(1 * MS, 150 * MS, 150 * MS), cur.label: current},
        n=2048,
        probe=(2048, 0.05),
        differing=[],
        seconds=60.0,
    )


def test_the_noisy_bound_is_twice_the_idle_p99_plus_the_median_slice() -> None:
    x = noisy(samples(1 * MS, 5 * MS, 150 * MS))
    assert x.idle_p99 == pytest.approx(1 * MS)  # nearest-rank: the 99th of 100
    assert x.bound == pytest.approx(2 * MS + 150 * MS)


def test_rows_hold_both_revisions_and_the_noisy_target_per_revision() -> None:
    m = measured(samples(1 * MS, 160 * MS, 150 * MS))
    rows = findings(m)
    assert len(rows) == 5
    for row in rows[:3]:  # idle, upload, download: both revisions side by side
        assert {"baseline abc1234", "current"} <= set(row.figures)
        assert row.ratio == pytest.approx(1.0) and row.met
    base_noisy, cur_noisy = rows[3], rows[4]
    assert base_noisy.name.endswith("baseline abc1234") and base_noisy.met  # 150 <= 152
    assert cur_noisy.name.endswith("current") and not cur_noisy.met  # 160 > 152
    assert cur_noisy.ratio == pytest.approx(160 / 152)
    bench_lanes._LAST["run"] = m
    notes = bench_lanes.notes(rows)
    assert "byte for byte the same" in notes[0]
    assert any(n.startswith("Missed: the noisy neighbour on current") for n in notes)
    table = render({"bench_lanes": rows})
    assert table.count("\n| noisy neighbour") == 2


def test_the_deadline_refuses_once_passed() -> None:
    deadline = Deadline(0.0)
    with pytest.raises(TimeoutError, match="deadline"):
        deadline.left("anything")
    assert Deadline(100.0).timeout("a call", most=5.0) == 5.0
