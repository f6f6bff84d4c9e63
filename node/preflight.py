"""Option values that name files, checked before the daemon creates or binds anything.

`build_config` checks what a value means on its own; these checks read the
file it names. A bad one is a bad flag: `FlagError` naming it, exit status 2,
and no port, folder, key or secret comes into being first.
"""

from __future__ import annotations

import pathlib

from machine.discovery_sim import SimError, load_sim_spec
from node.config import Config
from node.flags import FlagError

__all__ = ["check_option_files"]


def check_option_files(config: Config) -> None:
    """Raise FlagError naming the first flag whose file cannot be used."""
    if config.sim_file:
        try:
            load_sim_spec(pathlib.Path(config.sim_file))
        except SimError as exc:
            raise FlagError(f"--sim-file: {exc}") from exc
