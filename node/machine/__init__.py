"""The machine model: discovery, lanes, health, capacity, the journal and reconcile.

The bottom floor: imports nothing of the other packages. `supervisor` and
`capabilities` build on it; the application in `node` wires everything.
"""

from node.machine.ledger import Ledger
from node.machine.model import Machine, snapshot_once
from node.machine.readiness import Readiness
from node.machine.reservation import ReservationRefused
from node.machine.snapshot import NodeSnapshot

__all__ = [
    "Ledger",
    "Machine",
    "NodeSnapshot",
    "Readiness",
    "ReservationRefused",
    "snapshot_once",
]
