"""How guest processes are confined on this node, decided once at start-up.

`GuestPolicy` says whether guests run in a sandbox (bubblewrap), under which
uids (for a daemon that is not root: subordinate uids, taken in the user namespace
they are mapped in, `supervisor/subuids.py`), which device nodes exist, where the
node's Unix socket is, under which roots a guest's cwd may lie and under which it
may be written on the host;
`guest_session` turns one invocation's grant into what `run_process` needs and
gives it all back (uid, token file) once the invocation's processes are gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import re
import secrets
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from machine.cgroups import Cgroups
from machine.devnodes import lane_device_nodes
from machine.inventory import Inventory
from machine.lanes import Isolation, Lane
from supervisor.guest_cwd import SANDBOX_PLACES, Protected, open_cwd
from supervisor.identity import UidPool
from supervisor.process import ProcessStuck
from supervisor.sandbox import GUEST_TMP, NODE_SOCKET, TOKEN_FILE, SandboxSpec
from supervisor.subuids import GuestUserns
from supervisor.wire import GuestNetwork

__all__ = [
    "GuestPolicy",
    "GuestSession",
    "GuestsRefused",
    "adopt_uid",
    "guest_session",
    "remove_stale_tokens",
]

log = logging.getLogger(__name__)

# What `_token_file` names its files: nothing else in the run dir is touched.
_TOKEN_NAME = re.compile(r"guest-[0-9a-f]{32}\.tokens")
# A tokens memfd can change no more once written: not its bytes, not its size.
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


class GuestsRefused(RuntimeError):
    """This node cannot confine guests and the operator did not allow unconfined ones."""


@dataclasses.dataclass(frozen=True)
class GuestPolicy:
    # The sandbox tool; None runs guests unconfined (only when the operator allowed it).
    bwrap: Path | None
    # Each running guest gets its own uid from here; None: the daemon cannot switch users.
    uids: UidPool | None
    # Never reachable from a guest (keys, journal; the auth file among `hidden`).
    state_dir: Path
    # Further secrets (the auth file): masked wherever a guest's binds would reach them.
    hidden: tuple[Path, ...] = ()
    dev_root: Path = Path("/dev")
    # The node API's Unix socket, bound into every sandbox.
    node_socket: Path | None = None
    # Where guests' token folders are made (enterable by guests); None: the system temp dir.
    run_dir: Path | None = None
    # Why process work is refused here (no sandbox tool and unconfined not allowed).
    refusal: str | None = None
    # Per-invocation cgroups (memory, CPU quota, pids, devices); None: not enforceable here.
    cgroups: Cgroups | None = None
    pids_max: int = 1024
    # Real paths under which a guest's cwd is bound read-write: host writes no grant
    # bounds, the operator's trust decision. Elsewhere a cwd is read-only.
    writable_roots: tuple[Path, ...] = ()
    # Real paths a guest's cwd must be or lie under (`--guest-cwd-roots`), each writable
    # root counting as one too; `()` (serve's default): no request may name a cwd.
    # None: no allow-list, for the supervisor's own unit tests; the daemon always
    # gives one (node/guests.py).
    cwd_roots: tuple[Path, ...] | None = None
    # Whether a guest that asks for it may have the host's network namespace
    # (`--guest-host-network`); otherwise every guest has its own, loopback only.
    host_network: bool = False
    # A daemon that is not root: the user namespace its subordinate uids are mapped in,
    # entered by each guest to take its uid from `uids` (`supervisor/subuids.py`).
    userns: GuestUserns | None = None
    # litegraph-gate, where it was built and runs here (`supervisor/gate.py`).
    gate: Path | None = None
    # Its copy the guests' uids can reach, their keeper inside the sandbox (`install_keeper`).
    keeper: Path | None = None

    @classmethod
    def unconfined(cls, state_dir: Path) -> GuestPolicy:
        """No sandbox and no uid switch: unit tests of the supervisor's own logic."""
        return cls(bwrap=None, uids=None, state_dir=state_dir)

    def protected(self) -> list[Protected]:
        """What no guest's cwd may be, cover or lie inside."""
        places = [Protected(Path(p), f"the sandbox's private {p}") for p in SANDBOX_PLACES]
        places.append(Protected(self.state_dir, "the node's state folder"))
        run_dir = Path(tempfile.gettempdir()) if self.run_dir is None else self.run_dir
        places.append(Protected(run_dir, "the guests' run folder (their tokens, the socket)"))
        places += [Protected(path, "the node's auth file") for path in self.hidden]
        return places

    def allowed_roots(self) -> tuple[Path, ...] | None:
        """Where a cwd may lie: the cwd roots and the writable ones (a writable root a
        cwd could not lie under would be no use); None: anywhere else rules allow."""
        if self.cwd_roots is None:
            return None
        return tuple(dict.fromkeys((*self.cwd_roots, *self.writable_roots)))

    def check_cwd(self, cwd: str) -> None:
        """Refuse (`InvalidProcessRequest`) a cwd no guest may get; at admission, before
        a uid is chosen: where guests get uids of their own, one a guest uid could not
        reach (a 0700 or 0750 home) is refused now, with 422, not when it starts. The
        guest's start opens and checks it again, with its uid."""
        uid = None if self.uids is None else self.uids.any_guest
        fd, _ = open_cwd(cwd, self.protected(), uid, self.allowed_roots())
        os.close(fd)

    def host_writable(self, real: Path) -> bool:
        """Whether the cwd at `real` (where the opened folder really is) is bound read-write."""
        return any(real.is_relative_to(root) for root in self.writable_roots)

    def secrets(self) -> tuple[Path, ...]:
        return tuple(Path(os.path.realpath(p)) for p in (self.state_dir, *self.hidden))


@dataclasses.dataclass
class GuestSession:
    """What one guest holds while it runs: its uid, its token file, its sandbox."""

    uid: int | None
    sandbox: SandboxSpec | None
    env: dict[str, str]
    pids_max: int
    # What it got: `host` too where it runs unconfined (no sandbox, no namespace).
    network: GuestNetwork = GuestNetwork.NONE
    # Something of it survived SIGKILL (`run_process`'s on_stuck): its uid is never
    # handed out again, however its run ended.
    stuck: bool = False


def _token_text(tokens: Sequence[str]) -> bytes:
    return "".join(f"{token}\n" for token in tokens).encode("ascii")


@contextlib.contextmanager
def _token_file(tokens: Sequence[str], uid: int | None, where: Path | None) -> Iterator[Path]:
    """A file only `uid` can read (0400, owned by it), removed afterwards.

    It lies in the daemon's own folder (`--guest-run-dir`, 0711): the guest can
    reach the file but neither list the folder nor write in it, and the daemon
    removes it without reading the guest's files. One file, no folder of its own:
    every directory made costs the filesystem an inode on each guest's start.
    """
    folder = Path(tempfile.gettempdir()) if where is None else where
    path = folder / f"guest-{secrets.token_hex(16)}.tokens"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o400)
    try:
        try:
            if uid is not None:
                os.fchown(fd, uid, uid)
            os.write(fd, _token_text(tokens))
        finally:
            os.close(fd)
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def _token_data(tokens: Sequence[str]) -> Iterator[int]:
    """The tokens in a sealed memfd, for bubblewrap to copy into the guest's own mount
    namespace (`--ro-bind-data`): they never lie at a host path another process of
    the same uid (every guest in `dev`) could open, and no command line names one."""
    fd = os.memfd_create("litegraph-tokens", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, _token_text(tokens))
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        os.lseek(fd, 0, os.SEEK_SET)
        yield fd
    finally:
        os.close(fd)


def remove_stale_tokens(folder: Path) -> int:
    """Remove the token files in `folder` (the daemon's own run dir) at start-up: those a
    killed daemon left belong to uids it hands out again. Returns how many went."""
    removed = 0
    with os.scandir(folder) as entries:
        for entry in entries:
            if _TOKEN_NAME.fullmatch(entry.name) and not entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
    return removed


@contextlib.contextmanager
def guest_session(
    policy: GuestPolicy,
    *,
    isolation: Isolation,
    lanes: Sequence[Lane],
    tokens: Sequence[str],
    inventory: Inventory,
    cwd: str | None,
    node_url: str,
    memory_bytes: int | None = None,
    network: GuestNetwork = GuestNetwork.NONE,
) -> Iterator[GuestSession]:
    """Allocate a uid and a token file for one guest; give both back on exit.

    `memory_bytes` (its grant) sizes its private /tmp; `network` is what its request
    asked for (admission refused `host` unless the policy allows it)."""
    if policy.refusal is not None:
        raise GuestsRefused(policy.refusal)
    uid = policy.uids.allocate() if policy.uids is not None else None
    stuck = False
    # A sandboxed guest's tokens reach it through a descriptor; an unconfined one's
    # through a file of its uid's in the run dir.
    delivery: contextlib.AbstractContextManager[Path | int] = (
        _token_file(tokens, uid, policy.run_dir) if policy.bwrap is None else _token_data(tokens)
    )
    session: GuestSession | None = None
    try:
        with _opened_cwd(policy, cwd, uid) as folder, delivery as token_path:
            session = _session(
                policy,
                isolation,
                lanes,
                inventory,
                folder,
                node_url,
                uid,
                token_path,
                memory_bytes,
                network,
            )
            yield session
    except ProcessStuck:
        stuck = True  # something still runs under the uid: never hand it to another guest
        raise
    finally:
        if session is not None:
            uid = session.uid  # a ready sandbox's, where the guest started in one
        stuck = stuck or (session is not None and session.stuck)
        if uid is not None and policy.uids is not None and not stuck:
            policy.uids.release(uid)


def adopt_uid(policy: GuestPolicy, guest: GuestSession, uid: int | None) -> None:
    """The guest runs under `uid` (a ready sandbox's, now the guest's to give back):
    the one chosen for it goes back at once, unused (nothing ran under it)."""
    chosen, guest.uid = guest.uid, uid
    if chosen is not None and chosen != uid and policy.uids is not None:
        policy.uids.release(chosen)


@contextlib.contextmanager
def _opened_cwd(
    policy: GuestPolicy, cwd: str | None, uid: int | None
) -> Iterator[tuple[int, Path] | None]:
    """The guest's cwd opened and checked once (its descriptor, where it really is):
    the sandbox binds that descriptor, never the name, which a guest could swap."""
    if cwd is None:
        yield None
        return
    fd, real = open_cwd(cwd, policy.protected(), uid, policy.allowed_roots())
    try:
        yield fd, real
    finally:
        os.close(fd)


def _session(
    policy: GuestPolicy,
    isolation: Isolation,
    lanes: Sequence[Lane],
    inventory: Inventory,
    folder: tuple[int, Path] | None,
    node_url: str,
    uid: int | None,
    token_path: Path | int,
    memory_bytes: int | None,
    network: GuestNetwork,
) -> GuestSession:
    """The node's URL is given only to a guest with the host's network: in a namespace of
    its own the node's loopback address leads nowhere, and its socket is the way."""
    sandboxed = isolation is Isolation.SANDBOX
    if sandboxed:
        network = GuestNetwork.NONE  # the class's promise (admission refuses `host`)
    if policy.bwrap is None:
        network = GuestNetwork.HOST  # no sandbox, no namespace of its own
    env: dict[str, str] = {"LITEGRAPH_LANE_IDS": ",".join(lane.lane_id for lane in lanes)}
    if network is GuestNetwork.HOST and node_url and not sandboxed:
        env["LITEGRAPH_NODE_URL"] = node_url  # a sandbox guest uses the socket, even unconfined
    if policy.bwrap is None:
        assert isinstance(token_path, Path)
        env["LITEGRAPH_CAPABILITY_TOKEN_FILE"] = str(token_path)
        return GuestSession(
            uid=uid, sandbox=None, env=env, pids_max=policy.pids_max, network=network
        )
    nodes: dict[Path, None] = {}
    if not sandboxed:  # a sandbox guest gets no device node at all
        for lane in lanes:
            nodes.update(dict.fromkeys(lane_device_nodes(inventory, lane, policy.dev_root)))
    env["LITEGRAPH_CAPABILITY_TOKEN_FILE"] = TOKEN_FILE
    writable = folder is not None and policy.host_writable(folder[1])
    # A read-only cwd is no home: tools write their caches into the private /tmp.
    env["HOME"] = str(folder[1]) if folder is not None and writable else GUEST_TMP
    env["TMPDIR"] = GUEST_TMP
    if policy.node_socket is not None:
        env["LITEGRAPH_NODE_SOCKET"] = NODE_SOCKET
    sandbox = SandboxSpec(
        bwrap=policy.bwrap,
        isolate_network=network is not GuestNetwork.HOST,
        device_nodes=tuple(nodes),
        dev_root=policy.dev_root,
        token_fd=token_path if isinstance(token_path, int) else None,
        node_socket=policy.node_socket,
        cwd=None if folder is None else str(folder[1]),
        cwd_fd=None if folder is None else folder[0],
        cwd_writable=writable,
        masked=policy.secrets(),
        tmp_bytes=memory_bytes,
        userns_fd=None if policy.userns is None or uid is None else policy.userns.fd,
        gate=policy.gate,
        keeper=policy.keeper,
    )
    return GuestSession(
        uid=uid, sandbox=sandbox, env=env, pids_max=policy.pids_max, network=network
    )
