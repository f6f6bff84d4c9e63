"""The application: the command line, flags, config, logging and the daemon wiring.

The machine model lives in `node.machine`; only the application modules here
import every layer and wire them together.
"""

from node.config import Config, build_config
from node.flags import FlagError

__all__ = ["Config", "FlagError", "build_config"]
