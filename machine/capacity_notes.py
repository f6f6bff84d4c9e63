"""Start-up warnings: a node that can never admit work (nothing allocatable), and
simulated lanes promising less VRAM than their sim file declares.

Allocatable CPU or memory is capacity minus what the flags keep back
(`--reserved-cpu`, `--reserved-memory`). Capacity is the host's, or the
cgroup limit this process runs under (a container's memory limit), so a
small limit or a large reserve leaves none, and every invocation would be
refused with `insufficient_*`. The node still starts (an operator may be
about to fix it) but says so in the log and in `/readyz` notes.

Simulated VRAM is host memory (machine/sim_vram.py): when the host cannot hold
what the sim file declares, discovery notes the cap, and the snapshot says so.
"""

from __future__ import annotations

from collections.abc import Iterable

from machine.inventory import MemoryInfo
from machine.lanes import Lane
from machine.ledger import CapacityView, ResourceAmounts
from machine.sim_vram import SHARE

__all__ = ["capacity_notes", "simulated_vram_note"]

_MIB = 1 << 20


def _memory(amount: int) -> str:
    return f"{amount / _MIB:,.0f} MiB"


def _cpu(amount: int) -> str:
    return f"{amount:,} millis"


def capacity_notes(view: CapacityView) -> dict[str, str]:
    """readiness-note key -> warning, for each resource with nothing to allocate."""
    notes: dict[str, str] = {}
    checks = (
        ("cpu", "--reserved-cpu", view.cpu_millis, _cpu),
        ("memory", "--reserved-memory", view.memory_bytes, _memory),
    )
    for name, flag, amounts, show in checks:
        if _unreserved(amounts) > 0:
            continue
        notes[f"capacity:{name}"] = (
            f"no_allocatable_{name}: {flag} keeps back {show(amounts.reserved)} of this "
            f"node's {show(amounts.capacity)} (the host's, or its cgroup limit); "
            "no invocation can be admitted"
        )
    return notes


def _unreserved(amounts: ResourceAmounts) -> int:
    return amounts.capacity - amounts.reserved


def simulated_vram_note(lanes: Iterable[Lane], *, memory: MemoryInfo) -> str | None:
    """Why simulated lanes promise less VRAM than declared (`memory`: the host's, read
    at discovery), or None when none do."""
    simulated = [lane for lane in lanes if lane.declared_vram_bytes is not None]
    declared = sum(lane.declared_vram_bytes or 0 for lane in simulated)
    granted = sum(lane.vram_bytes for lane in simulated)
    if granted >= declared:
        return None
    numerator, denominator = SHARE
    return (
        f"simulated VRAM capped to host memory available: {granted:,} of {declared:,} bytes "
        f"({_memory(granted)} of the {_memory(declared)} the sim file declares); simulated "
        f"VRAM is host memory, and lanes get at most {numerator}/{denominator} of this "
        f"host's {_memory(memory.capacity_bytes)} (its cgroup limit when lower), never "
        f"more than the {_memory(memory.available_bytes)} available at start"
    )
