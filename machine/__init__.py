"""The machine model: discovery, lanes, health, capacity, the journal and reconcile.

On the bottom floor with `lanehost` and `capabilities`: imports nothing of the other
packages. `supervisor` and `api` build on it; the application in `node` wires everything.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
