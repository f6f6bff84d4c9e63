"""Start-up of guest confinement: what this node can enforce, and the guests' socket.

Decided once, before the supervisor starts: whether the daemon can give each
guest its own uid (the uid round resumed where the last run left it, uids that
something still runs under held back): as root or with CAP_SETUID and CAP_SETGID
from `--guest-uids`; in `dev` run by a normal user from its subordinate uids
(`/etc/subuid`, `/etc/subgid`) mapped into a user namespace made here, or, where it
has none (or the helpers are missing, or a guest cannot start so), not at all,
said as a `dev_guests_share_uid` note; whether the sandbox tool works here (a
real run of it, as a guest uid), and the folder that holds the node's Unix
socket and the guests' token files (any a killed daemon left are removed), the
roots a guest's cwd must lie under (said as a note: in `serve` none by default,
so a guest starts in its private /tmp) and those under which it is writable on
the host (said as a note: what a guest writes there no grant bounds).
What cannot be enforced is said at start-up, in the snapshot's notes and, where
it blocks process work, in /readyz.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
import pwd
import shutil
import socket
import stat
from dataclasses import dataclass, field

import trio

from api.unix_server import bind_unix_socket
from machine.cgroups import Cgroups, CgroupsUnavailable, system_cgroups
from node import guest_keeper
from node.config import Config
from supervisor.gate import find_gate
from supervisor.guests import GuestPolicy, remove_stale_tokens
from supervisor.identity import (
    UID_CURSOR_FILENAME,
    UidCursor,
    UidCursorError,
    UidPool,
    can_switch_users,
    parse_uid_range,
    running_uids,
)
from supervisor.launch import find_nsenter, plan
from supervisor.sandbox import SandboxSpec, SandboxUnavailable, find_bwrap
from supervisor.subuids import (
    SUBGID_FILE,
    SUBUID_FILE,
    GuestUserns,
    SubidsUnavailable,
    find_subid_tools,
    guest_subids,
    open_guest_userns,
)

__all__ = [
    "OWN_UIDS_NOTE",
    "SHARED_UID_NOTE",
    "GuestSetup",
    "GuestSetupError",
    "default_run_dir",
    "open_guest_setup",
]

log = logging.getLogger(__name__)

SOCKET_NAME = "node.sock"
SELF_TEST_SECONDS = 10.0
# The uid round over a normal user's subordinate uids, apart from --guest-uids' own.
SUBUID_CURSOR_FILENAME = "guest-subuid-cursor"
# What a `dev` run by a normal user says of its guests' uids (a note's first word).
OWN_UIDS_NOTE = "dev_guests_own_uids"
SHARED_UID_NOTE = "dev_guests_share_uid"


class GuestSetupError(Exception):
    """The guest folder or uid range is unusable; the daemon does not start."""


@dataclass
class GuestSetup:
    policy: GuestPolicy
    # Worth knowing (snapshot notes, start-up log): what is not enforced here.
    notes: list[str] = field(default_factory=list)
    # Set when process work is refused: the reason /readyz gives.
    blocked: str | None = None
    socket: socket.socket | None = None
    # Who guests run as, in words (dev's banner).
    identity: str = ""

    def close(self) -> None:
        """Let go of the guests' user namespace (once the daemon has stopped)."""
        if self.policy.userns is not None:
            self.policy.userns.close()


def default_run_dir(*, dev: bool, own_uids: bool = False) -> pathlib.Path:
    """`own_uids`: a `dev` whose guests have subordinate uids, which cannot enter the
    user's 0700 runtime folder to reach the node's socket."""
    if not dev:
        return pathlib.Path("/run/litegraph-node")
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime.startswith("/") and not own_uids:
        return pathlib.Path(runtime) / "litegraph-node"
    return pathlib.Path(f"/tmp/litegraph-node-{os.geteuid()}")  # noqa: S108 - checked below


def _prepare_run_dir(path: pathlib.Path) -> pathlib.Path:
    """The daemon's own folder, not a symlink, writable by nobody else, enterable by guests;
    the token files a killed daemon left there go (their uids are handed out again)."""
    try:
        path.mkdir(mode=0o711, parents=True, exist_ok=True)
        info = path.lstat()
    except OSError as exc:
        raise GuestSetupError(f"guest folder {path}: {exc.strerror}") from exc
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise GuestSetupError(f"guest folder {path}: not a plain folder (a symlink?)")
    if info.st_uid != os.geteuid():
        raise GuestSetupError(f"guest folder {path}: owned by uid {info.st_uid}, not the daemon")
    os.chmod(path, 0o711)  # noqa: S103 - guests may enter it, never list or write it
    try:
        removed = remove_stale_tokens(path)
    except OSError as exc:
        raise GuestSetupError(f"guest folder {path}: {exc.strerror}") from exc
    if removed:
        log.info("removed %d token files a previous run left in %s", removed, path)
    return path


def _uid_pool(
    uid_range: range, state_dir: pathlib.Path, cursor: str = UID_CURSOR_FILENAME
) -> UidPool:
    """The pool, resumed from its cursor; uids some process still runs under are held."""
    held = running_uids(uid_range)
    if held:
        log.warning(
            "%d guest uids still have processes (a guest that survived its end or the "
            "daemon): not handed out, e.g. %s",
            len(held),
            ", ".join(map(str, sorted(held)[:5])),
        )
    try:
        return UidPool(uid_range, cursor=UidCursor(state_dir / cursor), held=held)
    except UidCursorError as exc:
        raise GuestSetupError(
            f"guest uid cursor: {exc} (move it aside to start the round again)"
        ) from exc


async def _sandbox_works(
    bwrap: pathlib.Path,
    uid: int | None,
    userns: GuestUserns | None = None,
    node_socket: pathlib.Path | None = None,
    gate: pathlib.Path | None = None,
    keeper: pathlib.Path | None = None,
) -> str | None:
    """Run `true` in a sandbox the way a guest starts (its gate, setpriv, nsenter into
    the guests' user namespace or the in-child uid drop, bwrap); None when it works,
    else why not. With `node_socket`, bound as every guest's is (a subordinate uid
    must reach it)."""
    true = shutil.which("true", path="/usr/bin:/bin") or "/bin/true"
    # A sized /tmp as every guest gets: a bwrap without --size fails here, not per guest.
    sandbox = SandboxSpec(
        bwrap=bwrap,
        isolate_network=True,
        tmp_bytes=2**20,
        node_socket=node_socket,
        userns_fd=None if userns is None else userns.fd,
        gate=gate,
        keeper=keeper,
    )
    try:
        with trio.fail_after(SELF_TEST_SECONDS):
            launch = await trio.to_thread.run_sync(
                functools.partial(plan, [true], env={}, sandbox=sandbox, uid=uid, cgroup=None)
            )
            try:
                result = await trio.run_process(
                    launch.argv,
                    stdin=b"go\n",  # opens the gate (or bwrap's --block-fd)
                    capture_stderr=True,
                    check=False,
                    env=launch.env,
                    preexec_fn=launch.preexec_fn,
                    pass_fds=launch.pass_fds,
                    cwd="/",
                )
            finally:
                launch.close()
    except (OSError, trio.TooSlowError) as exc:
        return f"{bwrap} did not run: {exc}"
    if result.returncode != 0:
        text = result.stderr.decode(errors="replace").strip()[:300]
        return f"{bwrap} failed here (exit {result.returncode}): {text}"
    return None


async def _usable_sandbox(
    tool: str,
    uids: UidPool | None,
    problems: list[str],
    userns: GuestUserns | None = None,
    node_socket: pathlib.Path | None = None,
    gate: pathlib.Path | None = None,
    keeper: pathlib.Path | None = None,
) -> pathlib.Path | None:
    """The sandbox tool once a run of it as a guest uid worked; else None and why in `problems`."""
    try:
        bwrap = find_bwrap(tool)
    except SandboxUnavailable as exc:
        problems.append(str(exc))
        return None
    try:
        probe_uid = uids.allocate() if uids is not None else None
    except OSError as exc:  # the uid cursor could not be saved: no guest can start
        problems.append(f"guest uid cursor not saved: {exc}")
        return bwrap
    try:
        failure = await _sandbox_works(bwrap, probe_uid, userns, node_socket, gate, keeper)
    finally:
        if uids is not None and probe_uid is not None:
            uids.release(probe_uid)
    if failure is not None:
        problems.append(f"sandbox unusable: {failure}")
        return None
    return bwrap


def _writable_roots(config: Config, notes: list[str]) -> tuple[pathlib.Path, ...]:
    """The real paths of `--guest-writable-roots`, resolved once (cwds are compared by
    where they really are); each is said as a note, a trust decision the operator made."""
    roots = tuple(pathlib.Path(os.path.realpath(root)) for root in config.guest_writable_roots)
    if roots:
        notes.append(
            "guests may write on the host, unbounded by their grant, in a cwd under "
            + ", ".join(map(str, roots))
            + " (--guest-writable-roots); any other cwd is read-only"
        )
    return roots


def _cwd_roots(
    config: Config, writable: tuple[pathlib.Path, ...], notes: list[str]
) -> tuple[pathlib.Path, ...]:
    """The real paths of `--guest-cwd-roots`, resolved once like the writable roots;
    where a cwd may lie (these and the writable roots) is said as a note."""
    roots = tuple(pathlib.Path(os.path.realpath(root)) for root in config.guest_cwd_roots)
    allowed = tuple(dict.fromkeys((*roots, *writable)))
    if allowed:
        notes.append(
            "a guest's cwd must lie under "
            + ", ".join(map(str, allowed))
            + " (--guest-cwd-roots, --guest-writable-roots); a request naming another "
            "is refused (invalid_cwd), one naming none starts in its private /tmp"
        )
    else:
        notes.append(
            "no request may name a cwd: no --guest-cwd-roots or --guest-writable-roots "
            "given, so guests start in their private /tmp (invalid_cwd otherwise)"
        )
    return roots


def _own_name() -> str | None:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return None


def _own_user() -> str:
    uid = os.geteuid()
    name = _own_name()
    return f"{name} (uid {uid})" if name else f"uid {uid}"


def _shared_uid_note(reason: str) -> str:
    """What `dev` says when its guests share its uid, and why (`reason`)."""
    name = _own_name() or str(os.geteuid())
    return (
        f"{SHARED_UID_NOTE}: {reason}, so guests run as the daemon's own user {_own_user()}, "
        "which cannot switch users (not root, no CAP_SETUID and CAP_SETGID): a guest may "
        "read, change or remove what another wrote in a writable root, and a guest's token "
        "is a bearer token for every process of that user; each guest is still sandboxed "
        "(its own pid and mount namespaces, the state folder hidden). Ranges for "
        f"{name} in /etc/subuid and /etc/subgid, with newuidmap and newgidmap (uidmap), "
        "give each guest a uid of its own"
    )


def _own_uids_note(ids: range) -> str:
    name = _own_name() or str(os.geteuid())
    return (
        f"{OWN_UIDS_NOTE}: each running guest has a uid of its own, one of {name}'s "
        f"subordinate uids {ids.start}-{ids.stop - 1} (/etc/subuid, /etc/subgid), with "
        "no supplementary group: guests cannot read each other's files or signal each "
        "other; a guest reaches only the host folders other users may (a cwd under a "
        f"folder only {name} may enter is refused) and writes in a writable root only "
        f"where other users may; --no-guest-subuids runs guests as {name}"
    )


async def _subordinate_uids(
    config: Config, state_dir: pathlib.Path
) -> tuple[UidPool, GuestUserns] | str:
    """A pool over the user's subordinate uids and the user namespace they are mapped
    in; or why there are none (for the note)."""
    if not config.guest_subuids:
        return "--no-guest-subuids was given"
    try:
        # This module's names, read now: tests point them at files of their own.
        ids = guest_subids(
            _own_name(),
            os.geteuid(),
            os.getegid(),
            subuid_file=SUBUID_FILE,
            subgid_file=SUBGID_FILE,
        )
        if len(ids) < config.max_running:
            raise SubidsUnavailable(
                f"the subordinate uids {ids.start}-{ids.stop - 1} are fewer than "
                f"--max-running {config.max_running}"
            )
        tools = find_subid_tools()
        if find_nsenter() is None:
            raise SubidsUnavailable("nsenter not found (install util-linux)")
        pool = _uid_pool(ids, state_dir, SUBUID_CURSOR_FILENAME)
        # Not cancellable: the namespace made is returned, never lost to a cancel.
        userns = await trio.to_thread.run_sync(open_guest_userns, ids, tools)
    except SubidsUnavailable as exc:
        return str(exc)
    return pool, userns


async def _guest_uids(
    config: Config, *, dev: bool, state_dir: pathlib.Path, problems: list[str]
) -> tuple[UidPool | None, GuestUserns | None, str | None]:
    """Where each guest's uid comes from: `--guest-uids` where the daemon can switch
    users, in `dev` its subordinate uids; (None, None, why) where `dev`'s guests share
    its uid."""
    if can_switch_users():
        uid_range = parse_uid_range(config.guest_uids)
        if len(uid_range) < config.max_running:
            raise GuestSetupError(
                f"--guest-uids has {len(uid_range)} uids, fewer than --max-running "
                f"{config.max_running}"
            )
        return _uid_pool(uid_range, state_dir), None, None
    if not dev:
        problems.append(
            f"guests run as the daemon's own user {_own_user()}: it cannot switch users "
            "(not root, no CAP_SETUID and CAP_SETGID), so guests can read each other's "
            "environment and signal each other; the sandbox still hides the state folder"
        )
        return None, None, None
    found = await _subordinate_uids(config, state_dir)
    if isinstance(found, str):
        return None, None, found
    return *found, None


def _identity(
    uids: UidPool | None, userns: GuestUserns | None, shared: str | None, config: Config
) -> str:
    if userns is not None:
        ids = userns.ids
        return f"one each of your subordinate uids {ids.start}-{ids.stop - 1} (/etc/subuid)"
    if uids is not None:
        return f"one each from {config.guest_uids} (--guest-uids)"
    return f"all as you, {_own_user()}: {shared or 'cannot switch users'} ({SHARED_UID_NOTE})"


async def _keeper(gate: pathlib.Path, run_dir: pathlib.Path) -> pathlib.Path:
    try:
        return await trio.to_thread.run_sync(guest_keeper.keeper_path, gate, run_dir)
    except OSError as exc:
        raise GuestSetupError(f"guest keeper in {run_dir}: {exc.strerror}") from exc


async def open_guest_setup(
    config: Config, *, dev: bool, state_dir: pathlib.Path, auth_path: pathlib.Path
) -> GuestSetup:
    notes: list[str] = []
    problems: list[str] = []
    uids, userns, shared = await _guest_uids(
        config, dev=dev, state_dir=state_dir, problems=problems
    )
    sock: socket.socket | None = None
    try:
        # Guests with subordinate uids must reach the run dir: not the 0700 runtime folder.
        default = default_run_dir(dev=dev, own_uids=userns is not None)
        run_dir = _prepare_run_dir(
            pathlib.Path(config.guest_run_dir) if config.guest_run_dir else default
        )
        try:
            sock = bind_unix_socket(run_dir / SOCKET_NAME)
        except OSError as exc:
            raise GuestSetupError(f"guest socket in {run_dir}: {exc}") from exc
        tried: list[str] = []
        # A guest under a subordinate uid must also reach the node's socket: bound here.
        socket_path = None if userns is None else run_dir / SOCKET_NAME
        gate = await trio.to_thread.run_sync(find_gate)
        keeper = None if gate is None else await _keeper(gate, run_dir)
        bwrap = await _usable_sandbox(
            config.sandbox_tool, uids, tried, userns, socket_path, gate, keeper
        )
        if tried and keeper is not None:
            # The keeper itself may be what failed (its folder mounted noexec): without it.
            bare: list[str] = []
            bwrap = await _usable_sandbox(
                config.sandbox_tool, uids, bare, userns, socket_path, gate, None
            )
            if not bare:
                notes.append(guest_keeper.KEEPERLESS_NOTE.format(why="; ".join(tried)))
                keeper, tried = None, []
        if tried and userns is not None:
            # Not with a subordinate uid: guests share the daemon's, if the sandbox works so.
            shared = "a guest could not start under a subordinate uid: " + "; ".join(tried)
            userns.close()
            uids, userns, tried = None, None, []
            bwrap = await _usable_sandbox(
                config.sandbox_tool, None, tried, gate=gate, keeper=keeper
            )
        problems += tried
        if userns is not None:
            notes.append(_own_uids_note(userns.ids))
        elif shared is not None:
            notes.append(_shared_uid_note(shared))
    except BaseException:
        if userns is not None:
            userns.close()
        if sock is not None:
            sock.close()
        raise
    found = system_cgroups()
    cgroups = found if isinstance(found, Cgroups) else None
    if isinstance(found, CgroupsUnavailable):
        (notes if dev else problems).append(f"no limits from cgroups: {found.reason}")
    blocked = None
    if problems and config.allow_unconfined_guests:
        notes += [f"{p} (running guests anyway: --allow-unconfined-guests)" for p in problems]
    elif problems:
        blocked = "process work refused: " + "; ".join(problems)
    writable = _writable_roots(config, notes)
    policy = GuestPolicy(
        bwrap=bwrap,
        uids=uids,
        state_dir=state_dir,
        hidden=(auth_path,),
        dev_root=pathlib.Path(config.dev_root),
        node_socket=run_dir / SOCKET_NAME,
        run_dir=run_dir,
        refusal=blocked,
        cgroups=cgroups,
        pids_max=config.guest_pids_max,
        writable_roots=writable,
        cwd_roots=_cwd_roots(config, writable, notes),
        host_network=config.guest_host_network,
        userns=userns,
        gate=gate,
        keeper=keeper,
    )
    if config.guest_host_network:
        notes.append(
            "guests that ask for it get the host's network, its loopback services and "
            "other such guests included (--guest-host-network); all others have their own"
        )
    for note in notes:
        log.warning("%s", note)
    if blocked:
        log.error("%s", blocked)
    return GuestSetup(
        policy=policy,
        notes=notes,
        blocked=blocked,
        socket=sock,
        identity=_identity(uids, userns, shared, config),
    )
