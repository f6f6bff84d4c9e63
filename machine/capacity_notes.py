"""Start-up warnings for a node that can never admit work: nothing allocatable.

Allocatable CPU or memory is capacity minus what the flags keep back
(`--reserved-cpu`, `--reserved-memory`). Capacity is the host's, or the
cgroup limit this process runs under (a container's memory limit), so a
small limit or a large reserve leaves none, and every invocation would be
refused with `insufficient_*`. The node still starts (an operator may be
about to fix it) but says so in the log and in `/readyz` notes.
"""

from __future__ import annotations

from machine.ledger import CapacityView, ResourceAmounts

__all__ = ["capacity_notes"]

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
