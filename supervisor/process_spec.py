"""What one `process` invocation asks of the executor (`supervisor.process.run_process`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from supervisor.sandbox import SandboxSpec

__all__ = ["ProcessSpec"]


@dataclass(frozen=True)
class ProcessSpec:
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    # LITEGRAPH_CAPABILITY_TOKEN, LITEGRAPH_NODE_URL, LITEGRAPH_LANE_IDS, ...
    extra_env: Mapping[str, str] = field(default_factory=dict)
    # GPU or MIG uuids granted; empty means "no device", never "all devices".
    visible_devices: tuple[str, ...] = ()
    cpu_affinity: tuple[int, ...] | None = None
    memory_limit_bytes: int | None = None
    cpu_only: bool = True
    # Unique per live invocation (use the invocation id): it names the cgroup.
    cgroup_name: str = "invocation"
    # Run as this uid, with the gid of the same number and no supplementary groups.
    uid: int | None = None
    # Run inside this sandbox (bubblewrap); None runs the argv directly.
    sandbox: SandboxSpec | None = None
    # CPU quota (thousandths of a CPU) and process limit of the cgroup; None: no limit.
    cpu_millis: int | None = None
    pids_max: int | None = None
