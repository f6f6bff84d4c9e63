"""The machine: discovery, lanes, health, capacity, config and the daemon wiring."""

from node.config import Config, build_config
from node.flags import FlagError
from node.ledger import Ledger, ReservationRefused
from node.machine import Machine
from node.readiness import Readiness
from node.snapshot import NodeSnapshot

__all__ = [
    "Config",
    "FlagError",
    "Ledger",
    "Machine",
    "NodeSnapshot",
    "Readiness",
    "ReservationRefused",
    "build_config",
]
