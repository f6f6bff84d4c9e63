"""The `process` executor: run one invocation as a child process group.

The child starts in its own session (so its process group id is its pid) with
stdin from /dev/null, a tight environment, the devices it was granted and
nothing else, and optionally a memory limit and a CPU set. However the run
ends - normal exit, an exception, the caller's cancel scope or deadline,
KeyboardInterrupt - the whole process group is ended: SIGTERM, up to
`kill_grace` seconds for it to empty, then SIGKILL. That cleanup runs shielded
and with its own deadline, and then whatever ended the run propagates.

Memory: a per-invocation cgroup (v1 or v2, `machine.cgroups`) when the host allows it;
otherwise RLIMIT_AS, but only for CPU-only work (CUDA reserves huge virtual
address ranges, so an address-space limit would break GPU work); otherwise
the limit is not enforced by the kernel and a warning is logged.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import trio

from machine.cgroups import (
    CGROUP_NAME_RE,
    CgroupError,
    CgroupLimits,
    Cgroups,
    CgroupUsage,
    InvocationCgroup,
    system_cgroups,
)
from machine.kept_thread import KeptThread
from machine.proc import process_start_ticks
from machine.procgroup import terminate_group
from supervisor.launch import Launch, plan
from supervisor.output import OutputRing, Sink, pump
from supervisor.sandbox import SandboxSpec
from supervisor.spawn import Child, spawn

__all__ = [
    "ENV_ALLOW_LIST",
    "RESERVED_ENV_NAMES",
    "SYSTEM_CGROUPS",
    "ConfinementFailed",
    "InvalidProcessRequest",
    "ProcessSpec",
    "ProcessStuck",
    "build_environment",
    "run_process",
    "terminate_group",
    "validate_argv",
    "validate_env",
    "validate_spec",
]

log = logging.getLogger(__name__)

# What a child inherits from the daemon's own environment; nothing else leaks.
ENV_ALLOW_LIST = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TERM",
    "USER",
    "LOGNAME",
    "TMPDIR",
)
# Set by the supervisor, or able to change what runs (the loader, an interpreter's
# start-up, a shell's init file) or which devices a runtime uses. Compared in
# upper case: several runtimes read these names case-insensitively.
RESERVED_ENV_NAMES = frozenset(
    {
        "BASH_ENV",
        "BASHOPTS",
        "ENV",
        "GCONV_PATH",
        "GETCONF_DIR",
        "GLIBC_TUNABLES",
        "GPU_DEVICE_ORDINAL",
        "HOSTALIASES",
        "IFS",
        "JAVA_TOOL_OPTIONS",
        "_JAVA_OPTIONS",
        "LOCALDOMAIN",
        "LOCPATH",
        "MALLOC_CHECK_",
        "MALLOC_TRACE",
        "NLSPATH",
        "NODE_OPTIONS",
        "OPENSSL_CONF",
        "PERL5LIB",
        "PERL5OPT",
        "PERLLIB",
        "PS4",
        "RES_OPTIONS",
        "RESOLV_HOST_CONF",
        "RUBYLIB",
        "RUBYOPT",
        "SHELLOPTS",
        "TMPDIR",
    }
)
RESERVED_ENV_PREFIXES = (
    "LITEGRAPH_",
    "LD_",  # LD_PRELOAD, LD_AUDIT, LD_LIBRARY_PATH, ...
    "DYLD_",
    "PYTHON",  # PYTHONPATH, PYTHONSTARTUP, PYTHONHOME, ...
    "CUDA_",  # CUDA_VISIBLE_DEVICES, CUDA_MPS_PIPE_DIRECTORY, ...
    "NVIDIA_",
    "HIP_",
    "ROCR_",
    "HSA_",
)
DEVICE_ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
# Set for every guest unless its request sets them (so these few are not reserved):
# Python writes each line as it is printed, so followers of the logs see it live.
GUEST_DEFAULT_ENV = {"PYTHONUNBUFFERED": "1"}

MAX_ENV_ENTRIES = 64
MAX_ENV_ITEM_BYTES = 4096
MAX_SUPERVISOR_ENV_BYTES = 128 * 1024 - 1
MAX_ARGV_ENTRIES = 256
MAX_ARGV_ITEM_BYTES = 4096

_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# GPU-<uuid>, MIG-<uuid>, MIG-GPU-<uuid>/<gi>/<ci>: never a separator or blank.
_DEVICE_ID_RE = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")

# After the group is gone: how long the pumps may take to read what is left
# in the pipes (longer only if something outside the group holds them).
_DRAIN_SECONDS = 1.0

# Every guest's cgroup work (mkdir, limits, usage, rmdir: blocking cgroupfs calls) runs
# on this one thread, in turn.
_CGROUP_THREAD = KeptThread("litegraph-cgroups", idle_exit=None)

# run_process's default: this host's cgroups, detected on first use.
SYSTEM_CGROUPS: Literal["system"] = "system"
# Until CPU and pids limits are part of the spec: the whole machine, and the kernel's pid cap.
_NO_PIDS_LIMIT = 4_194_304


class InvalidProcessRequest(ValueError):
    """The caller asked for something this executor refuses (the caller's fault)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ConfinementFailed(RuntimeError):
    """The guest's cgroup could not be made: it does not run without its limits."""


class ProcessStuck(RuntimeError):
    """The child survived SIGKILL within the wait (e.g. stuck in the kernel)."""

    def __init__(self, pid: int) -> None:
        super().__init__(f"process {pid} did not exit after SIGKILL")
        self.pid = pid


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


# -- validation --------------------------------------------------------------


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


def is_reserved_env_name(name: str) -> bool:
    upper = name.upper()
    if name in GUEST_DEFAULT_ENV:
        return False
    return upper in RESERVED_ENV_NAMES or upper.startswith(RESERVED_ENV_PREFIXES)


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


def build_environment(spec: ProcessSpec, parent_env: Mapping[str, str]) -> dict[str, str]:
    """Allow-listed daemon variables < guest defaults < the invocation's env <
    supervisor variables."""
    env = {name: parent_env[name] for name in ENV_ALLOW_LIST if name in parent_env}
    env.update(GUEST_DEFAULT_ENV)
    env.update(spec.env)
    env.update(spec.extra_env)
    # Last, so nothing above can widen the device set; "" hides every GPU.
    devices = ",".join(spec.visible_devices)
    for name in DEVICE_ENV_NAMES:
        env[name] = devices
    return env


# -- ending a process group --------------------------------------------------
# terminate_group (SIGTERM, grace, SIGKILL) lives in machine.procgroup, shared with
# reconcile; it is re-exported here.


async def _wait_exit_unreaped(proc: Child, pidfd: int | None) -> None:
    """Wait for the leader to exit but leave it a zombie.

    While the zombie exists its pid - the group id - cannot be reused, so the
    SIGTERM that follows cannot reach an unrelated process group.
    """
    if pidfd is None:
        await proc.wait()
    else:
        await trio.lowlevel.wait_readable(pidfd)


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None  # old kernel: fall back to waiting with reaping


# -- running -----------------------------------------------------------------


async def _watch_oom(cgroup: InvocationCgroup, scope: trio.CancelScope) -> None:
    with scope:
        await cgroup.kill_after_oom()


def _cgroup_limits(spec: ProcessSpec, memory_bytes: int) -> CgroupLimits:
    cpus = len(os.sched_getaffinity(0))
    # A sandboxed guest may open only its grant's device nodes (v1's devices controller).
    nodes = spec.sandbox.device_nodes if spec.sandbox is not None else None
    return CgroupLimits(
        memory_bytes=memory_bytes,
        cpu_millis=spec.cpu_millis or cpus * 1000,
        pids_max=spec.pids_max or _NO_PIDS_LIMIT,
        devices=None if nodes is None else tuple(str(node) for node in nodes),
    )


def _memory_plan(
    spec: ProcessSpec, cgroups: Cgroups | None
) -> tuple[InvocationCgroup | None, int | None]:
    """(cgroup, RLIMIT_AS bytes) enforcing spec.memory_limit_bytes (and the other limits)."""
    limit = spec.memory_limit_bytes
    if limit is None:
        return None, None
    if cgroups is not None:
        limits = _cgroup_limits(spec, limit)
        try:
            return cgroups.create(spec.cgroup_name, limits), None
        except CgroupError as exc:
            # The node has cgroups: a guest without one would escape its CPU, pids
            # and device limits and the whole-cgroup kill. It does not run.
            raise ConfinementFailed(f"no cgroup for {spec.cgroup_name}: {exc}") from exc
    if spec.cpu_only:
        return None, limit
    log.warning(
        "memory limit of %d bytes for %s not enforced: no usable cgroup and "
        "RLIMIT_AS would break GPU work",
        limit,
        spec.cgroup_name,
    )
    return None, None


def _prepare(
    spec: ProcessSpec, cgroups: Cgroups | None, env: Mapping[str, str]
) -> tuple[InvocationCgroup | None, Launch]:
    """The cgroup (made here) and how the child starts; blocking, for the cgroup thread."""
    cgroup, rlimit_as = _memory_plan(spec, cgroups)
    try:
        launch = plan(
            spec.argv,
            env=env,
            sandbox=spec.sandbox,
            uid=spec.uid,
            cgroup=cgroup,
            rlimit_as=rlimit_as,
            affinity=spec.cpu_affinity,
        )
    except BaseException:
        if cgroup is not None:
            cgroup.finish_if_empty()  # nothing joined it yet
        raise
    return cgroup, launch


async def run_process(
    spec: ProcessSpec,
    *,
    stdout: OutputRing,
    stderr: OutputRing,
    on_started: Callable[[int, int | None], Awaitable[None]],
    kill_grace: float = 5.0,
    cgroups: Cgroups | Literal["system"] | None = SYSTEM_CGROUPS,
    parent_env: Mapping[str, str] | None = None,
    on_usage: Callable[[CgroupUsage], None] | None = None,
    sinks: tuple[Sink, Sink] | None = None,
) -> int:
    """Run `spec` to the end and return its exit code (negative: killed by that signal).

    `on_started(pid, start_ticks)` is awaited right after spawn and before the
    argv runs (the child waits for it); (pid, start_ticks) identifies the
    process even after pid reuse. If it raises, the child is killed without
    ever running the argv. `cgroups=None` never uses cgroups; `parent_env`
    defaults to os.environ. `sinks` (stdout's, stderr's) see every chunk of output
    as it comes (the invocation's log files). `on_usage` gets the cgroup's own counters (CPU time,
    peak memory, OOM kills, refused forks) once everything in it has ended.
    """
    validate_spec(spec)
    env = build_environment(spec, os.environ if parent_env is None else parent_env)
    if isinstance(cgroups, str):  # SYSTEM_CGROUPS
        found = system_cgroups()
        cgroups = found if isinstance(found, Cgroups) else None
    # mkdir and the limit writes cost milliseconds of kernel time: not on the event
    # loop. Never lost to a cancel (the job completes; spawn's failure path below
    # removes the cgroup).
    cgroup, launch = await _CGROUP_THREAD.run(
        functools.partial(_prepare, spec, cgroups, env), shield=True
    )
    gate_read, gate_write = os.pipe()
    try:
        proc = await spawn(
            launch.argv,
            stdin=gate_read,
            env=launch.env,
            # In a sandbox the guest's folder is bound by bwrap; the guest's uid
            # may not be able to enter the daemon's own working directory.
            cwd="/" if spec.sandbox is not None else spec.cwd,
            preexec_fn=launch.preexec_fn,
            place=launch.place,
            pass_fds=launch.pass_fds,
        )
    except BaseException:
        os.close(gate_write)
        if cgroup is not None:
            with trio.move_on_after(10, shield=True):
                await cgroup.remove()
        raise
    finally:
        os.close(gate_read)
        launch.close()
    pgid = proc.pid  # start_new_session: the child leads its own group
    pidfd = _open_pidfd(proc.pid)
    ended = False

    async def end_group() -> None:
        # Once only: after the group is gone its id could be reused.
        nonlocal ended
        if ended:
            return
        ended = True
        with trio.move_on_after(kill_grace + 15, shield=True):
            await terminate_group(pgid, kill_grace, leader=proc)
            if cgroup is not None:
                # Usually nothing is left: usage and removal in one worker-thread call.
                finished = await _CGROUP_THREAD.run(cgroup.finish_if_empty, shield=True)
                if finished is not None:
                    usage, removed = finished
                    if on_usage is not None and usage is not None:
                        on_usage(usage)
                    if not removed:
                        await cgroup.remove()
                    return
                # What escaped the group (a setsid() grandchild) is still in the cgroup.
                try:
                    await cgroup.kill()
                except CgroupError as exc:
                    log.error("%s: %s", spec.cgroup_name, exc)
                if on_usage is not None:
                    try:
                        on_usage(cgroup.usage())
                    except CgroupError as exc:  # unread counters never keep the cgroup
                        log.error("%s: no usage: %s", spec.cgroup_name, exc)
                await cgroup.remove()

    try:
        try:
            # Not reaped yet, so /proc still shows it even if it already exited.
            await on_started(proc.pid, process_start_ticks(proc.pid))
            os.write(gate_write, b"\n")
        except BaseException:
            # Kill before the pipe closes: a closed gate must never let the argv run.
            await end_group()
            raise
        finally:
            os.close(gate_write)
        async with trio.open_nursery() as nursery:
            out_sink, err_sink = sinks or (None, None)
            nursery.start_soon(pump, proc.stdout, stdout, out_sink)
            nursery.start_soon(pump, proc.stderr, stderr, err_sink)
            oom_watch = trio.CancelScope()
            if cgroup is not None and cgroup.version == "v1":
                # v1's OOM killer ends one process; an invocation ends whole (v2: oom.group).
                nursery.start_soon(_watch_oom, cgroup, oom_watch)
            await _wait_exit_unreaped(proc, pidfd)
            oom_watch.cancel()
            # A normal exit too ends the group: grandchildren left behind go as well,
            # and then the pipes reach EOF.
            await end_group()
            nursery.cancel_scope.deadline = min(
                nursery.cancel_scope.deadline, trio.current_time() + _DRAIN_SECONDS
            )
    finally:
        # Exception, cancellation, KeyboardInterrupt: same ending, then it propagates.
        await end_group()
        if pidfd is not None:
            os.close(pidfd)
        await proc.aclose()
    if proc.returncode is None:
        raise ProcessStuck(proc.pid)
    return proc.returncode
