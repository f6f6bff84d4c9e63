"""Ready sandboxes: a guest's sandbox and cgroups made before its request arrives.

Starting a confined guest costs milliseconds that the request then waits for: its
cgroups made and limited in each hierarchy, the uid drop, bubblewrap's namespaces
and mounts. The pool does that ahead, per *shape* (everything a sandbox and its
cgroups are made of: the grant's memory, CPU and devices, the network, the masks;
not the command, its environment or its tokens), for guests that name no cwd (a
cwd is bound from the descriptor the daemon opened for that request). A ready
sandbox is litegraph-gate's stage (`supervisor/gate.py`) waiting on its stdin,
already in its fresh cgroups and under its fresh uid; starting a guest in it is one
write of the command, environment and tokens, and one exec.

Each ready sandbox is used at most once: the uid comes from the same round-robin
pool as every guest's, the cgroups are made for it (named `_pool-<state folder's
tag>-<run>-<n>`, a name no invocation id can have), its /tmp is a new tmpfs. Nothing in
it ran anything of a guest's before its guest's command arrived. None outlives
the daemon: its stage reads end of file when the daemon's end of the pipe closes
(and runs nothing), bwrap dies with the daemon (`--die-with-parent`), and a
restarted daemon removes what cgroups are left (`machine.model`).

Bounds: at most `size` ready sandboxes in all, of the `MAX_SHAPES` most recently
used shapes, which share it (a full pool ends a ready sandbox of the shape holding
most to fill another); fills run one at a time in the background, resting after
each so that filling uses at most `cpu_share` of a core's time; the pool never
takes a uid the running guests might need. A pool that cannot fill (no uid, no
cgroup, a sandbox that would not start) counts the failure and the guest starts
the direct way.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import secrets
import signal
from pathlib import Path

import trio

from machine.cgroups import CgroupError, Cgroups, InvocationCgroup, pool_cgroup_prefix
from machine.proc import process_start_ticks
from supervisor.gate import stage_argv
from supervisor.identity import UidPool, UidsExhausted
from supervisor.process_cgroup import CGROUP_THREAD, ConfinementFailed, prepare_launch
from supervisor.process_spec import ProcessSpec
from supervisor.sandbox import TOKEN_FILE, SandboxSpec, SandboxUnavailable
from supervisor.spawn import Child, spawn

__all__ = ["PoolCounts", "ReadySandbox", "SandboxPool", "shape_of"]

log = logging.getLogger(__name__)

MAX_SHAPES = 4
# A discarded sandbox's stage exits at once on end of file; past this it is killed.
_DISCARD_SECONDS = 2.0
_WANTED_QUEUE = 16

Shape = tuple[tuple[int, ...] | None, int | None, bool, int | None, int | None, SandboxSpec]


def shape_of(spec: ProcessSpec) -> Shape | None:
    """What a ready sandbox for `spec` is made of; None where none can be made ahead
    (no sandbox, a cwd to bind, no litegraph-gate)."""
    sandbox = spec.sandbox
    if sandbox is None or sandbox.cwd is not None or sandbox.keeper is None or sandbox.stage:
        return None
    return (
        spec.cpu_affinity,
        spec.memory_limit_bytes,
        spec.cpu_only,
        spec.cpu_millis,
        spec.pids_max,
        dataclasses.replace(sandbox, token_fd=None),
    )


@dataclasses.dataclass(eq=False)
class ReadySandbox:
    """A stage waiting for its guest: its uid, cgroup and process, and the pipe its
    command goes down (`command`, the write end; closing it unused runs nothing)."""

    uid: int | None
    cgroup: InvocationCgroup | None
    proc: Child
    command: int
    start_ticks: int | None

    def alive(self) -> bool:
        return self.proc.returncode is None and self.proc.poll() is None

    async def end(self) -> None:
        """End it unused (shielded, bounded): its stage reads end of file and exits
        having run nothing; what is left is killed with its cgroup, which goes. Its uid
        is the caller's to give back (once `proc.returncode` says it is gone)."""
        os.close(self.command)
        with trio.CancelScope(shield=True):
            with trio.move_on_after(_DISCARD_SECONDS):
                await self.proc.wait()
            try:
                if self.cgroup is not None:
                    await self.cgroup.kill()
                elif self.proc.returncode is None:
                    os.killpg(self.proc.pid, signal.SIGKILL)
            except (CgroupError, ProcessLookupError) as exc:
                log.error("sandbox pool: %s", exc)
            with trio.move_on_after(_DISCARD_SECONDS):
                await self.proc.wait()
            await self.proc.aclose()
            if self.cgroup is not None:
                with trio.move_on_after(_DISCARD_SECONDS):
                    await self.cgroup.remove()


@dataclasses.dataclass
class PoolCounts:
    """Since start: guests started in a ready sandbox, the direct way, and fills that
    failed (the metrics' counters)."""

    pooled: int = 0
    direct: int = 0
    fill_failures: int = 0


class SandboxPool:
    def __init__(
        self,
        *,
        size: int,
        uids: UidPool | None,
        cgroups: Cgroups | None,
        state_dir: Path,
        keep_uids: int,
        cpu_share: float = 0.5,
    ) -> None:
        self.size = size
        self._uids = uids
        self._cgroups = cgroups
        # This run's names: never one a dead daemon's cgroup that stayed still has.
        self._prefix = f"{pool_cgroup_prefix(state_dir)}{secrets.token_hex(4)}-"
        # Uids the running guests may need: never held by ready sandboxes.
        self._keep_uids = keep_uids
        self._cpu_share = cpu_share
        self._ready: collections.OrderedDict[Shape, list[ReadySandbox]] = collections.OrderedDict()
        self._templates: dict[Shape, ProcessSpec] = {}
        self._send, self._wanted = trio.open_memory_channel[Shape](_WANTED_QUEUE)
        self._made = 0
        # Taken from the pool dead (their stage exited): ended by the filler.
        self._doomed: list[ReadySandbox] = []
        self.counts = PoolCounts()

    @property
    def ready(self) -> int:
        return sum(len(entries) for entries in self._ready.values())

    def count_start(self, *, pooled: bool) -> None:
        if pooled:
            self.counts.pooled += 1
        else:
            self.counts.direct += 1

    def take(self, spec: ProcessSpec) -> ReadySandbox | None:
        """A ready sandbox of `spec`'s shape, now the caller's (its uid too); None
        where there is none. Either way the shape is filled again in the background."""
        shape = shape_of(spec)
        if shape is None or self.size <= 0:
            return None
        self._want(shape, spec)
        entries = self._ready.get(shape)
        while entries:
            entry = entries.pop(0)
            if entry.alive():
                return entry
            self._discard_later(entry)  # its stage died: never used
        return None

    def _want(self, shape: Shape, spec: ProcessSpec) -> None:
        if shape not in self._templates:
            self._templates[shape] = dataclasses.replace(
                spec,
                argv=tuple(stage_argv(TOKEN_FILE)),
                env={},
                extra_env={},
                visible_devices=(),
                uid=None,
                sandbox=dataclasses.replace(shape[5], stage=True),
            )
        self._ready.setdefault(shape, [])
        self._ready.move_to_end(shape)
        try:
            self._send.send_nowait(shape)
        except trio.WouldBlock:
            pass  # fills are asked for faster than they run: the queue has it already

    def _discard_later(self, entry: ReadySandbox) -> None:
        self._doomed.append(entry)

    async def run(self) -> None:
        """Fill shapes as they are asked for, until cancelled; then end every ready
        sandbox (shielded, bounded)."""
        try:
            async for shape in self._wanted:
                await self._end_doomed()
                await self._forget_old_shapes()
                while await self._room(shape):
                    started = trio.current_time()
                    try:
                        entry = await self._fill(shape)
                    except (
                        OSError,
                        UidsExhausted,
                        ConfinementFailed,
                        CgroupError,
                        SandboxUnavailable,
                    ) as exc:
                        self.counts.fill_failures += 1
                        log.warning("sandbox pool: no ready sandbox made: %s", exc)
                        break
                    self._ready.setdefault(shape, []).append(entry)
                    spent = trio.current_time() - started
                    await trio.sleep(spent * (1 / self._cpu_share - 1))
        finally:
            with trio.move_on_after(_DISCARD_SECONDS * 2, shield=True):
                entries = [e for es in self._ready.values() for e in es] + self._doomed
                self._ready.clear()
                self._doomed = []
                async with trio.open_nursery() as nursery:
                    for entry in entries:
                        nursery.start_soon(self.discard, entry)

    async def _room(self, shape: Shape) -> bool:
        """Whether `shape` may have one more; a full pool ends a ready sandbox of a
        shape that holds more than this one, so shapes in use share the pool."""
        entries = self._ready.get(shape)
        if entries is None:
            return False
        uids = self._uids
        if uids is not None and uids.available <= self._keep_uids:
            return False
        if self.ready < self.size:
            return True
        richest = max(self._ready.values(), key=len)
        if len(richest) <= len(entries) + 1:
            return False
        await self.discard(richest.pop(0))
        return True

    async def _forget_old_shapes(self) -> None:
        while len(self._ready) > MAX_SHAPES:
            shape, entries = self._ready.popitem(last=False)
            self._templates.pop(shape, None)
            for entry in entries:
                await self.discard(entry)

    async def _end_doomed(self) -> None:
        doomed, self._doomed = self._doomed, []
        for entry in doomed:
            await self.discard(entry)

    async def _fill(self, shape: Shape) -> ReadySandbox:
        uid = self._uids.allocate() if self._uids is not None else None
        self._made += 1
        spec = dataclasses.replace(
            self._templates[shape], uid=uid, cgroup_name=f"{self._prefix}{self._made}"
        )
        cgroup: InvocationCgroup | None = None
        try:
            cgroup, launch = await CGROUP_THREAD.run(
                functools.partial(prepare_launch, spec, self._cgroups, {}), shield=True
            )
            gate_read, gate_write = os.pipe()
            try:
                if launch.preexec_fn is not None:
                    raise SandboxUnavailable("a guest started from a forked child is not pooled")
                proc = await spawn(
                    launch.argv,
                    stdin=gate_read,
                    env=launch.env,
                    cwd="/",
                    preexec_fn=None,
                    place=launch.place,
                    pass_fds=launch.pass_fds,
                )
            except BaseException:
                os.close(gate_write)
                raise
            finally:
                os.close(gate_read)
                launch.close()
        except BaseException:
            with trio.move_on_after(_DISCARD_SECONDS, shield=True):
                if cgroup is not None:
                    await cgroup.remove()
            if uid is not None and self._uids is not None:
                self._uids.release(uid)
            raise
        # The gate opens: bubblewrap builds the sandbox, and the stage waits there.
        os.write(gate_write, b"\n")
        return ReadySandbox(
            uid=uid,
            cgroup=cgroup,
            proc=proc,
            command=gate_write,
            start_ticks=process_start_ticks(proc.pid),
        )

    async def discard(self, entry: ReadySandbox) -> None:
        """End a ready sandbox no guest will use, then give its uid back."""
        await entry.end()
        if entry.uid is not None and self._uids is not None and entry.proc.returncode is not None:
            self._uids.release(entry.uid)
