"""The machine model: discovery, lanes, health, capacity, the journal and reconcile.

On the bottom floor with `lanehost` and `capabilities`: imports nothing of the other
packages. `supervisor` and `api` build on it; the application in `node` wires everything.
"""

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
