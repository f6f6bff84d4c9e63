"""Refusing a `process` request before anything is made for it: argv, environment,
devices, limits, cgroup name and uid, each checked against the executor's bounds.
A refusal is the caller's fault (`InvalidProcessRequest`, 422 at the edge)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from machine.cgroups import CGROUP_NAME_RE
from supervisor.process_env import is_reserved_env_name
from supervisor.process_spec import ProcessSpec

__all__ = ["InvalidProcessRequest", "validate_argv", "validate_env", "validate_spec"]

MAX_ENV_ENTRIES = 64
MAX_ENV_ITEM_BYTES = 4096
MAX_SUPERVISOR_ENV_BYTES = 128 * 1024 - 1
MAX_ARGV_ENTRIES = 256
MAX_ARGV_ITEM_BYTES = 4096

_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# GPU-<uuid>, MIG-<uuid>, MIG-GPU-<uuid>/<gi>/<ci>: never a separator or blank.
_DEVICE_ID_RE = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")


class InvalidProcessRequest(ValueError):
    """The caller asked for something this executor refuses (the caller's fault)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _check_text(field_name: str, value: object, limit: int) -> str:
    if not isinstance(value, str):
        raise InvalidProcessRequest(field_name, "must be a string")
    if "\x00" in value:
        raise InvalidProcessRequest(field_name, "contains a NUL byte")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidProcessRequest(field_name, "is not valid UTF-8 text") from None
    if size > limit:
        raise InvalidProcessRequest(field_name, f"longer than {limit} bytes")
    return value


def validate_env(env: Mapping[str, str]) -> None:
    """Refuse an invocation environment that is too big, malformed or reserved."""
    if len(env) > MAX_ENV_ENTRIES:
        raise InvalidProcessRequest("env", f"more than {MAX_ENV_ENTRIES} variables")
    for name, value in env.items():
        _check_text("env", name, MAX_ENV_ITEM_BYTES)
        if not _ENV_NAME_RE.fullmatch(name):
            raise InvalidProcessRequest(f"env.{name}", "not a valid variable name")
        if is_reserved_env_name(name):
            raise InvalidProcessRequest(f"env.{name}", "reserved: set by the node only")
        _check_text(f"env.{name}", value, MAX_ENV_ITEM_BYTES)


def validate_argv(argv: Sequence[str]) -> None:
    """1..256 arguments, each at most 4 KiB without NUL; argv[0] not empty."""
    if isinstance(argv, str | bytes):
        raise InvalidProcessRequest("argv", "must be a list of strings")
    if not 1 <= len(argv) <= MAX_ARGV_ENTRIES:
        raise InvalidProcessRequest("argv", f"must have 1 to {MAX_ARGV_ENTRIES} entries")
    for index, arg in enumerate(argv):
        _check_text(f"argv[{index}]", arg, MAX_ARGV_ITEM_BYTES)
    if not argv[0]:
        raise InvalidProcessRequest("argv[0]", "must not be empty")


def validate_spec(spec: ProcessSpec) -> None:
    """Everything run_process relies on, checked before anything is created."""
    validate_argv(spec.argv)
    validate_env(spec.env)
    for name, value in spec.extra_env.items():
        _check_text("extra_env", name, MAX_ENV_ITEM_BYTES)
        if not _ENV_NAME_RE.fullmatch(name):
            raise InvalidProcessRequest(f"extra_env.{name}", "not a valid variable name")
        # The supervisor's own values (one token per lane) may be longer than a
        # guest's; the kernel's limit for one string is 128 KiB.
        _check_text(f"extra_env.{name}", value, MAX_SUPERVISOR_ENV_BYTES)
    for device in spec.visible_devices:
        if not isinstance(device, str) or not _DEVICE_ID_RE.fullmatch(device):
            raise InvalidProcessRequest("visible_devices", f"invalid device id {device!r}")
    if spec.cwd is not None:
        _check_text("cwd", spec.cwd, MAX_ARGV_ITEM_BYTES)
    if spec.cpu_only and spec.visible_devices:
        # CPU-only work may get RLIMIT_AS, which breaks CUDA: a contradiction, refuse it.
        raise InvalidProcessRequest("cpu_only", "devices granted to CPU-only work")
    if spec.memory_limit_bytes is not None and spec.memory_limit_bytes <= 0:
        raise InvalidProcessRequest("memory_limit_bytes", "must be positive")
    if spec.cpu_affinity is not None:
        allowed = os.sched_getaffinity(0)
        if not spec.cpu_affinity or not set(spec.cpu_affinity) <= allowed:
            raise InvalidProcessRequest(
                "cpu_affinity", f"must be a non-empty subset of {sorted(allowed)}"
            )
    if not CGROUP_NAME_RE.fullmatch(spec.cgroup_name):
        raise InvalidProcessRequest("cgroup_name", "must match [A-Za-z0-9_][A-Za-z0-9_.-]*")
    if spec.uid is not None and (spec.uid <= 0 or spec.uid == os.geteuid()):
        raise InvalidProcessRequest("uid", "a guest never runs as root or as the daemon's user")
