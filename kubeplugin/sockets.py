"""Where a DRA driver's sockets live on a node, and the kubelet's rules for them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DRIVER_NAME", "KUBELET_PLUGINS", "KUBELET_REGISTRY", "PluginSockets", "SocketError"]

DRIVER_NAME = "lanes.litegraph.dev"
KUBELET_PLUGINS = Path("/var/lib/kubelet/plugins")
KUBELET_REGISTRY = Path("/var/lib/kubelet/plugins_registry")
# AF_UNIX's sun_path, its terminating NUL included.
_UNIX_PATH_MAX = 108
# A DNS subdomain, lower case, at most 63 characters: what kubelet takes as a driver name.
_DRIVER = re.compile(r"(?=.{1,63}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class SocketError(ValueError):
    """A driver name or socket path kubelet would not take."""


@dataclass(frozen=True)
class PluginSockets:
    """The registration socket kubelet watches for and the DRA service socket it dials."""

    registration: Path
    service: Path

    @classmethod
    def for_driver(
        cls, driver: str, *, registry: Path = KUBELET_REGISTRY, plugins: Path = KUBELET_PLUGINS
    ) -> PluginSockets:
        if not _DRIVER.fullmatch(driver):
            raise SocketError(f"driver name {driver!r}: not a lower-case DNS subdomain of <= 63")
        found = cls(registry / f"{driver}-reg.sock", plugins / driver / "dra.sock")
        for path in (found.registration, found.service):
            if len(str(path).encode()) >= _UNIX_PATH_MAX:
                raise SocketError(f"{path}: longer than a Unix socket path may be (107 bytes)")
        return found
