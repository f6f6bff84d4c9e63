"""The composition root: builds every component from the Config and runs them
in one trio nursery until a signal or an explicit stop asks for shutdown.

Start-up order: the state folder is checked (or created 0700) and locked
(`node/statelock.py`: one daemon per folder) before anything else, then the
HTTP server (probes answer while the rest starts), then keys, discovery,
journal recovery, the supervisor and its lane owners, the health monitor and
telemetry. /readyz turns 200 once all are done.
Shutdown: stop admitting, give running work `--shutdown-grace`, cancel the
rest (each guest gets SIGTERM and `--kill-grace` before SIGKILL), release
everything, close the journal. The API serves on until the supervisor is done,
so whoever follows an invocation learns how it ended; then the servers close.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
import threading
from typing import TYPE_CHECKING, Any

import trio

from api.app import create_app
from api.auth import Authenticator
from api.context import NodeContext
from api.device_history import DeviceHistory
from api.metrics import NodeMetrics, SandboxPoolFigures
from api.server import serve_http
from api.settings import HttpSettings
from api.snapshot_cache import SnapshotCache
from api.telemetry import TelemetryPusher
from api.unix_server import serve_unix
from capabilities import TokenService
from capabilities.push_signature import PushSigner
from machine import Machine
from machine.capacity_notes import capacity_notes
from machine.cgroups import CgroupsUnavailable, system_cgroups
from machine.disk_floor import DiskFloor
from machine.health import HealthTransition
from machine.journal import JournalError, release_reserve
from machine.readiness import Readiness
from machine.snapshot import NodeSnapshot
from node.address import remove_address
from node.config import Config, DeviceMode
from node.guests import GuestSetup, GuestSetupError, open_guest_setup
from node.sdnotify import notify
from node.signals import SignalWatcher, sole_error
from node.startup import StartupError, open_secrets, telemetry_bearer
from node.statedir import StateDirError, prepare_state_dir
from node.statelock import lock_state_dir
from supervisor.core import Supervisor
from supervisor.events import EventHub
from supervisor.lane_host import lane_host_factory
from supervisor.logstore import LogLimits, LogStore, LogStoreError
from supervisor.sandbox_pool import SandboxPool
from supervisor.wire import InvocationState, NodeEvent

if TYPE_CHECKING:
    from collections.abc import Callable

    from lightkube import AsyncClient
    from quart_trio import QuartTrio

__all__ = ["Daemon", "StartupError", "http_settings", "lane_host_env", "startup_error_in"]

log = logging.getLogger(__name__)
# Past this, whatever has not stopped after the grace period is cancelled.
SHUTDOWN_MARGIN = 15.0
# Once running work has ended: how long the HTTP server gets to close (Hypercorn
# gives busy connections its graceful timeout, 3 s).
SERVERS_CLOSE_SECONDS = 5.0
# After shutdown ended running work: how long the servers still answer, so a `run`
# that was between two requests when it ended still learns how it ended.
FOLLOWERS_SECONDS = 0.25
EVENT_SUBSCRIBERS = 32
EVENT_BUFFER = 256
# Live (invocation, lane) tokens; admission holds far fewer (max-queued + max-running).
LIVE_TOKENS = 65536


def _pool_figures(pool: SandboxPool) -> SandboxPoolFigures:
    counts = pool.counts
    return SandboxPoolFigures(counts.pooled, counts.direct, counts.fill_failures, pool.ready)


def http_settings(config: Config) -> HttpSettings:
    return HttpSettings(
        listen=config.listen,
        read_timeout=config.http_read_timeout,
        body_timeout=config.http_body_timeout,
        keep_alive=config.http_keep_alive,
        metrics_auth=config.metrics_auth,
    )


LANE_HOST_CACHE = "lanehost-cache"  # in the state folder


def lane_host_env(state_dir: pathlib.Path) -> dict[str, str]:
    """Where the lane hosts' CUDA caches live: a folder of the state folder (the
    daemon's own, 0700; its hosts run as its uid), so `import cupy`, which makes
    its kernel cache folder at import, works whatever HOME is (a read-only one in
    a container), and no guest can write a kernel the trusted host would load.
    StartupError if it cannot be made."""
    root = state_dir / LANE_HOST_CACHE
    folders = {"CUPY_CACHE_DIR": root / "cupy", "CUDA_CACHE_PATH": root / "cuda"}
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        os.chmod(root, 0o700)  # whatever the umask said
        for folder in folders.values():
            folder.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise StartupError(f"lane host cache {root}: {exc.strerror or exc}") from exc
    return {name: str(folder) for name, folder in folders.items()}


def startup_error_in(error: BaseException) -> StartupError | None:
    """The StartupError when that is all `error` holds (nurseries wrap it in groups)."""
    return sole_error(error, StartupError)


class Daemon:
    """One node daemon. `await nursery.start(daemon.run)` returns the bound URL."""

    def __init__(
        self,
        config: Config,
        *,
        handle_signals: bool = True,
        dev: bool = False,
        pynvml_module: Any = None,
    ) -> None:
        self.config = config
        self.dev = dev
        self.stop = trio.Event()
        # Set once running work has ended on the way out: the API servers close then.
        self.served = trio.Event()
        self._http_closed = trio.Event()
        self.readiness = Readiness(("http", "keys", "discovery", "journal", "supervisor"))
        self.context = NodeContext(
            http=http_settings(config), readiness=self.readiness, metrics=NodeMetrics()
        )
        self.url = ""
        self.auth_path = pathlib.Path(
            config.auth_file or pathlib.Path(config.state_dir) / "auth.json"
        )
        self.machine: Machine | None = None
        self.supervisor: Supervisor | None = None
        # How guests are confined here (dev's banner says who they run as).
        self.guests: GuestSetup | None = None
        self.telemetry: TelemetryPusher | None = None
        # The DRA driver's API server client (`--kubelet-plugin`); tests name their own.
        self.kube_client: Callable[[], AsyncClient] | None = None
        self._handle_signals = handle_signals
        self._pynvml = pynvml_module
        self._signals = SignalWatcher(self.stop, self._shutdown_plan)

    def _shutdown_plan(self) -> str:
        """What a graceful stop waits for, in words, at the moment it is asked for."""
        counts = self.supervisor.counts() if self.supervisor is not None else {}
        left = counts.get(InvocationState.queued, 0) + counts.get(InvocationState.running, 0)
        if not left:
            return "stopping; no invocation is running"
        plural = "" if left == 1 else "s"
        grace = self.config.shutdown_grace
        return f"stopping; waiting up to {grace:g}s for {left} invocation{plural} to finish"

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until `stop`; a start-up that cannot proceed raises a bare StartupError
        (not wrapped in the nurseries' exception groups) so callers can name it, and a
        second signal ends it early with a bare `ForcedStop`."""
        try:
            await self._run(task_status)
        except BaseExceptionGroup as group:
            startup = startup_error_in(group)
            if startup is None:
                raise
            raise startup from startup.__cause__

    async def _run(self, task_status: trio.TaskStatus[str]) -> None:
        state_dir = pathlib.Path(self.config.state_dir)
        try:
            prepare_state_dir(state_dir)
            # Before anything in the folder is read or written: one daemon per folder.
            lock = await lock_state_dir(state_dir, wait=self.config.state_lock_wait)
        except StateDirError as exc:
            raise StartupError(str(exc)) from exc
        try:
            # On a full disk the journal's reserve is the room start-up writes need; the
            # journal takes it back when it opens, or once the disk has it (not ready).
            release_reserve(state_dir)
        except (OSError, JournalError) as exc:
            lock.release()
            raise StartupError(f"journal reserve: {exc}") from exc
        try:
            async with trio.open_nursery() as outer:
                if self._handle_signals and threading.current_thread() is threading.main_thread():
                    await outer.start(self._signals.run)
                with self._signals.work:
                    await self._serve(task_status)
                outer.cancel_scope.cancel()  # the signal watcher never ends by itself
        finally:
            # While still the folder's owner: the next daemon may write its own at once.
            remove_address(state_dir)
            lock.release()
        self._signals.raise_if_forced()
        log.info("stopped")

    async def _serve(self, task_status: trio.TaskStatus[str]) -> None:
        self._app = app = create_app(self.context)
        try:
            async with trio.open_nursery() as components:
                try:
                    addresses = await components.start(self._serve_http, app)
                except BaseException as raised:  # re-raised unless the bind itself failed
                    if (taken := sole_error(raised, OSError)) is None:
                        raise
                    why = taken.strerror or str(taken)
                    raise StartupError(f"cannot listen on {self.config.listen}: {why}") from taken
                self.url = addresses[0]
                self.readiness.done("http")
                log.info("listening on %s", self.url)
                await self._start_components(components)
                notify("READY=1")
                task_status.started(self.url)
                await self.stop.wait()
                notify("STOPPING=1")
                self.readiness.block("shutdown", "the node is stopping")
                # Past what shutdown waits for: the grace, the guests' endings and their
                # cleanup, and the servers' closing (each ending's own steps are shielded
                # and bounded, and finish even past this).
                grace = self.config.shutdown_grace
                waits = (
                    self.supervisor.shutdown_seconds(grace)
                    if self.supervisor is not None
                    else grace
                )
                components.cancel_scope.deadline = (
                    trio.current_time()
                    + waits
                    + FOLLOWERS_SECONDS
                    + SERVERS_CLOSE_SECONDS
                    + SHUTDOWN_MARGIN
                )
                if self.context.events is not None:
                    # Event streams end cleanly now, inside the server's grace period.
                    self.context.events.close()
                if self.supervisor is not None and await self.supervisor.shutdown(grace):
                    await trio.sleep(FOLLOWERS_SECONDS)
                # Only now do the servers close: a `run` following an invocation was
                # answered how it ended (`cancelled`, `shutdown`), its logs are complete.
                self.served.set()
                with trio.move_on_after(SERVERS_CLOSE_SECONDS):
                    await self._http_closed.wait()
                components.cancel_scope.cancel()
        finally:
            with trio.move_on_after(10, shield=True):
                if self.machine is not None:
                    await self.machine.aclose()
            if self.guests is not None:
                self.guests.close()  # the guests' user namespace, where there is one

    async def _serve_http(
        self, app: QuartTrio, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Hypercorn until `served`: through shutdown's grace and the guests' endings."""
        try:
            await serve_http(app, self.context.http, self.served, task_status=task_status)
        finally:
            self._http_closed.set()

    async def _start_components(self, nursery: trio.Nursery) -> None:
        config = self.config
        state_dir = pathlib.Path(config.state_dir)
        auth, created, keyring = open_secrets(state_dir, self.auth_path)
        bearer = telemetry_bearer(config.telemetry_bearer_file)
        if created:
            log.info("created operator secrets in %s (mode 0600)", self.auth_path)
        self.context.auth = Authenticator(auth)
        self.readiness.done("keys")
        self.machine = machine = await self._open_machine(state_dir)
        self.readiness.done("discovery")
        self.readiness.done("journal")
        self.readiness.check("journal", machine.journal_problem)
        for key, warning in capacity_notes(machine.ledger.capacity()).items():
            log.warning("%s", warning)
            self.readiness.note(key, warning)
        for reason in machine.inventory.readiness_reasons:
            # Only an operator who demanded NVML is not ready without it.
            if config.devices is DeviceMode.nvml:
                self.readiness.block("devices", reason)
            else:
                self.readiness.note("devices", reason)
        self.guests = guests = await self._open_guests(state_dir)
        logs = await self._open_logs(state_dir)
        nursery.start_soon(logs.run)
        notes = tuple(guests.notes)
        snapshots = SnapshotCache(lambda changes: self._snapshot(machine, changes, notes))
        events: EventHub[NodeEvent] = EventHub(EVENT_SUBSCRIBERS, EVENT_BUFFER)
        tokens = TokenService(
            machine.node_id, keyring, ttl=config.token_ttl, max_live_tokens=LIVE_TOKENS
        )
        self.readiness.check("tokens", tokens.full_reason)
        self.supervisor = supervisor = Supervisor(
            machine,
            tokens,
            events,
            # Each lane's own backend (`Lane.array_backend`): CuPy on NVML's GPUs and MIG
            # instances, never falling back to host memory; NumPy on simulated lanes
            # (host memory even where CuPy is installed) and the CPU pool.
            lane_host_factory(config.lane_host_command, env=lane_host_env(state_dir)),
            max_queued=config.max_queued,
            max_running=config.max_running,
            max_kernel_seconds=config.max_kernel_seconds,
            node_url=self.url,
            kill_grace=config.kill_grace,
            hurry=self._signals.forced,
            sandbox_pool=config.sandbox_pool,
            on_change=snapshots.mark_changed,
            guests=guests.policy,
            logs=logs,
            on_lane_host_call=self.context.metrics.observe_lane_host,
        )
        self.readiness.check("lane_hosts", supervisor.lane_hosts_problem)
        self.readiness.check_note("lane_hosts", supervisor.faulted_lanes)
        self.readiness.check_note("cuda", supervisor.cuda_unavailable_lanes)
        await nursery.start(supervisor.run)
        if guests.socket is not None:
            # Guests reach the node until their work has ended, shutdown's grace included.
            nursery.start_soon(serve_unix, self._app, self.context.http, guests.socket, self.served)
        self.context.snapshots = snapshots
        self.context.history = history = DeviceHistory(config.health_interval)
        self.context.events = events
        self.context.supervisor = supervisor
        self.context.metrics.snapshot = snapshots.current
        self.context.metrics.invocation_counts = supervisor.counts
        self.context.metrics.ended_totals = supervisor.ended_totals
        self.context.metrics.claims_held = lambda: len(supervisor.holds.holds)
        if supervisor.pool is not None:
            self.context.metrics.sandbox_pool = functools.partial(_pool_figures, supervisor.pool)
        self.readiness.check("drained", supervisor.drain_reason)
        self.readiness.done("supervisor")
        nursery.start_soon(machine.watch_journal)
        nursery.start_soon(machine.expire_ended)
        nursery.start_soon(
            functools.partial(
                machine.monitor,
                interval=config.health_interval,
                probe_timeout=max(1.0, config.health_interval * 2),
                on_probe=functools.partial(self._on_probe, snapshots, history),
            )
        )
        if config.scheduler_url:
            self.telemetry = TelemetryPusher(
                config.scheduler_url,
                config.telemetry_interval,
                snapshots.encoded,
                node_id=machine.node_id,
                sign=PushSigner(keyring, machine.node_id, config.scheduler_url).sign,
                bearer=bearer,
            )
            await nursery.start(self.telemetry.run)
        if not config.kubelet_plugin:
            self.readiness.check_note("standing_holds", supervisor.holds.unserved)
        else:
            # Imported only here: the Kubernetes libraries are the `kubernetes` extra's.
            try:
                from node.kube_driver import run_kube_driver
            except ImportError as exc:
                raise StartupError(
                    f"--kubelet-plugin needs the kubernetes extra "
                    f"(pip install 'litegraph-node[kubernetes]'): {exc}"
                ) from exc

            await nursery.start(
                run_kube_driver, config, supervisor, self._app, self.context.http, self.kube_client
            )

    def _snapshot(self, machine: Machine, changes: int, notes: tuple[str, ...]) -> NodeSnapshot:
        drained = self.supervisor.drain_reason() if self.supervisor is not None else None
        return machine.snapshot(
            sequence=changes,
            notes=notes,
            drained=drained is not None,
            readiness_reasons=() if drained is None else (drained,),
        )

    async def _open_guests(self, state_dir: pathlib.Path) -> GuestSetup:
        try:
            guests = await open_guest_setup(
                self.config, dev=self.dev, state_dir=state_dir, auth_path=self.auth_path
            )
        except GuestSetupError as exc:
            raise StartupError(str(exc)) from exc
        for note in guests.notes:
            self.readiness.note(f"guests:{len(self.readiness.notes())}", note)
        if guests.blocked is not None:
            self.readiness.block("guests", guests.blocked)
        return guests

    async def _open_logs(self, state_dir: pathlib.Path) -> LogStore:
        config = self.config
        limits = LogLimits(
            invocation_bytes=config.logs_max_bytes,
            total_bytes=config.logs_total_bytes,
            retention_s=config.logs_retention,
        )
        # Free space the logs leave on the journal's filesystem (--state-min-free).
        floor = DiskFloor(state_dir, config.state_min_free)
        try:
            return await LogStore.open(state_dir / "logs", limits, floor)
        except (OSError, LogStoreError) as exc:
            raise StartupError(str(exc)) from exc

    async def _open_machine(self, state_dir: pathlib.Path) -> Machine:
        config = self.config
        devices = config.devices.value
        if self.dev and config.devices is DeviceMode.auto:
            devices = "workstation"
        # Unavailable cgroups are reported with the guests' confinement (node.guests).
        cgroups = system_cgroups()
        try:
            return await Machine.open(
                node_id=config.node_id,
                devices=devices,
                sim_file=pathlib.Path(config.sim_file) if config.sim_file else None,
                state_dir=state_dir,
                reserved_cpu_millis=config.reserved_cpu,
                reserved_memory_bytes=config.reserved_memory,
                vram_headroom_bytes=config.vram_headroom,
                fatal_xids=frozenset(config.fatal_xids),
                recovery_probes=config.recovery_probes,
                on_transition=self._on_transition,
                pynvml_module=self._pynvml,
                dev_root=pathlib.Path(config.dev_root),
                cgroups=None if isinstance(cgroups, CgroupsUnavailable) else cgroups,
                accept_journal_loss=config.accept_journal_loss,
                idempotency_window=config.idempotency_window,
                idempotency_max_ids=config.idempotency_max_ids,
            )
        except (OSError, ValueError, JournalError) as exc:
            raise StartupError(str(exc)) from exc

    @staticmethod
    def _on_probe(snapshots: SnapshotCache, history: DeviceHistory) -> None:
        snapshots.mark_changed()  # readings move every probe
        history.record(snapshots.current())

    def _on_transition(self, event: HealthTransition) -> None:
        log.info(
            "device %s: %s -> %s (%s)",
            event.device_id,
            event.from_state.value,
            event.to_state.value,
            "; ".join(event.reasons),
        )
        if self.supervisor is not None:
            self.supervisor.on_health(event)
        if self.context.snapshots is not None:
            self.context.snapshots.mark_changed()
        if self.telemetry is not None:
            self.telemetry.nudge()
