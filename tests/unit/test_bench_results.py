"""bench/run_all.py: running some benchmarks replaces only their sections of RESULTS.md."""

from __future__ import annotations

from bench.harness import Finding
from bench.run_all import merge, render

OLD = """# Benchmark results

Written by `make bench` (bench/run_all.py); do not edit by hand.

Measured 2026-01-01 00:00 UTC on a machine.

## bench_a

old a

## bench_b

old b
"""


def test_a_partial_run_replaces_only_its_sections_and_dates_them() -> None:
    finding = Finding(name="n", target="t", figures={"x": "1"}, ratio=1.0, met=True)
    merged = merge(OLD, render({"bench_b": [finding], "bench_c": [finding]}))
    assert merged.startswith(OLD.split("## bench_a")[0])  # the head is kept
    assert "## bench_a\n\nold a\n" in merged  # not run: kept as it was
    assert "old b" not in merged
    b = merged.split("## bench_b\n", 1)[1].split("## bench_c")[0]
    assert b.lstrip().startswith("Measured ") and "| n | x: 1 | 1.00 | t | yes |" in b
    assert merged.index("## bench_a") < merged.index("## bench_b") < merged.index("## bench_c")
