"""The machine model: discovery, lanes, health, capacity, the journal and reconcile.

On the bottom floor with `lanehost` and `capabilities`: imports nothing of the other
packages. `supervisor` and `api` build on it; the application in `node` wires everything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from machine.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from machine.ledger import Ledger
    from machine.model import Machine, snapshot_once
    from machine.readiness import Readiness
    from machine.reservation import ReservationRefused
    from machine.snapshot import NodeSnapshot

__all__ = [
    "Ledger",
    "Machine",
    "NodeSnapshot",
    "Readiness",
    "ReservationRefused",
    "snapshot_once",
]

# Imported on first use, so a command that needs one module of the package does not
# pay for all of them (the CLI starts in a fraction of the time).
_WHERE = {
    "Ledger": "machine.ledger",
    "Machine": "machine.model",
    "snapshot_once": "machine.model",
    "Readiness": "machine.readiness",
    "ReservationRefused": "machine.reservation",
    "NodeSnapshot": "machine.snapshot",
}

__getattr__ = lazy_exports(__name__, _WHERE)
