"""The application: the command line, flags, config, logging and the daemon wiring.

The top floor: only the application modules here import every other package
(`machine`, `capabilities`, `lanehost`, `supervisor`, `api`) and wire them together.
"""

from node.config import Config, build_config
from node.flags import FlagError

__all__ = ["Config", "FlagError", "build_config"]
