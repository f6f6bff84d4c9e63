"""The machine: discovery, lanes, health, capacity, config and the daemon wiring."""

from node.config import Config, build_config
from node.flags import FlagError
from node.readiness import Readiness

__all__ = ["Config", "FlagError", "Readiness", "build_config"]
