"""The DRA driver inside the daemon (`--kubelet-plugin`): kubelet's plugin sockets
served (`kubeplugin.server`), the node's lanes published as ResourceSlices
(`kubeplugin.publisher`, every PUBLISH_SECONDS: a round changes nothing when nothing
changed, and puts back what kubelet or anyone wiped), their health streamed to kubelet
(`kubeplugin.health`), and each prepared claim a
standing hold in the node's own ledger (`supervisor.standing_holds`) with its
tokens in the claim's folder and a socket of its own there (`api.hold_sockets`).

A restart keeps every hold (the journal's); at start each one's folder gets fresh
tokens and its socket again, so its pods carry on with no Prepare.
"""

from __future__ import annotations

import datetime
import functools
import logging
from collections.abc import Callable, Collection
from pathlib import Path

import trio
from lightkube import AsyncClient
from lightkube.core.exceptions import ConfigError
from quart_trio import QuartTrio

from api.hold_sockets import HoldSockets, HoldSocketsFull
from api.settings import HttpSettings
from kubeplugin.cdi import SOCKET_NAME
from kubeplugin.claims import ClaimPlan, ClaimRefused
from kubeplugin.files import claim_folder, write_tokens
from kubeplugin.health import DeviceHealthReading
from kubeplugin.preparer import ClaimPreparer, Granted
from kubeplugin.publisher import PublishError, SlicePublisher
from kubeplugin.server import serve_plugin
from kubeplugin.slices import OfferedDevice
from kubeplugin.sockets import DRIVER_NAME, PluginSockets, SocketError
from node.config import Config
from node.kube_lanes import (
    KubeLaneError,
    device_health,
    hold_grant,
    offered_devices,
    passthrough_of,
)
from node.startup import StartupError
from supervisor.core import Supervisor
from supervisor.hold import Hold
from supervisor.standing_holds import HoldRefused

__all__ = ["PUBLISH_SECONDS", "KubeDriver", "run_kube_driver"]

log = logging.getLogger(__name__)

PUBLISH_SECONDS = 10.0


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubeDriver:
    """What kubelet's Prepare and Unprepare do to the node (`reserve`, `release`)."""

    def __init__(
        self,
        supervisor: Supervisor,
        sockets: HoldSockets,
        *,
        claims_dir: Path,
        shared_gpus: Collection[str],
        dev_root: Path = Path("/dev"),
    ) -> None:
        self._sup = supervisor
        self._dev_root = dev_root
        self._sockets = sockets
        self._claims_dir = claims_dir
        self._shared = shared_gpus
        supervisor.holds.on_tokens = self._write_tokens

    def devices(self) -> list[OfferedDevice]:
        machine = self._sup.machine
        return list(offered_devices(machine.ledger, machine.inventory, self._shared))

    def health(self) -> list[DeviceHealthReading]:
        return device_health(self._sup.machine.ledger, self._shared)

    def restore(self) -> None:
        """Every hold the node keeps: its folder's tokens and its socket again."""
        for hold in list(self._sup.holds.holds.values()):
            try:
                self._write_tokens(hold)
                self._sockets.open(hold.subject, self._folder(hold) / SOCKET_NAME)
            except (OSError, HoldSocketsFull) as exc:
                log.error("claim %s: not served again: %s", hold.claim_uid, exc)

    async def reserve(self, plan: ClaimPlan) -> Granted:
        ledger = self._sup.machine.ledger
        try:
            grants = [hold_grant(device, ledger, self._shared) for device in plan.devices]
            through = passthrough_of(
                plan.devices, grants, ledger, self._sup.machine.inventory, self._dev_root
            )
        except KubeLaneError as exc:
            raise ClaimRefused(exc.reason, str(exc)) from None
        try:
            hold, new = await self._sup.holds.hold(plan.claim.uid, grants)
        except HoldRefused as refused:
            raise ClaimRefused(refused.reason, str(refused)) from None
        try:
            self._sockets.open(hold.subject, self._folder(hold) / SOCKET_NAME)
        except (OSError, HoldSocketsFull) as exc:
            if new:
                await self.release(plan.claim.uid)
            raise ClaimRefused("prepare_failed", f"no socket for the claim: {exc}") from None
        if new:
            log.info(
                "claim %s/%s (%s) held for pods %s: lanes %s",
                plan.claim.namespace,
                plan.claim.name,
                plan.claim.uid,
                ", ".join(plan.pod_uids) or "none yet",
                ", ".join(hold.lane_ids),
            )
        return Granted(
            lane_ids=hold.lane_ids,
            tokens=tuple(hold.tokens[lane] for lane in hold.lane_ids),
            new=new,
            passthrough=through,
        )

    async def release(self, claim_uid: str) -> None:
        hold = self._sup.holds.get(claim_uid)
        if hold is None:
            return
        self._sockets.close(hold.subject)
        try:
            await self._sup.holds.release(claim_uid)
        except HoldRefused as refused:
            self._sockets.open(hold.subject, self._folder(hold) / SOCKET_NAME)  # still held
            raise ClaimRefused(refused.reason, str(refused)) from None

    def _folder(self, hold: Hold) -> Path:
        return claim_folder(self._claims_dir, hold.claim_uid)

    def _write_tokens(self, hold: Hold) -> None:
        if hold.tokens:
            write_tokens(self._folder(hold), [hold.tokens[lane] for lane in hold.lane_ids])


async def _publish_forever(publisher: SlicePublisher) -> None:
    problem = ""
    while True:
        try:
            changed = await publisher.publish()
            if changed or problem:
                log.info("ResourceSlices published (generation %d)", publisher.generation)
            problem = ""
        except PublishError as exc:
            if str(exc) != problem:
                log.error("ResourceSlices not published: %s", exc)
            problem = str(exc)
        await trio.sleep(PUBLISH_SECONDS)


async def run_kube_driver(
    config: Config,
    supervisor: Supervisor,
    app: QuartTrio,
    http: HttpSettings,
    client_factory: Callable[[], AsyncClient] | None = None,
    *,
    task_status: trio.TaskStatus[KubeDriver] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the driver until cancelled; started once its sockets are served."""
    kubelet = Path(config.kubelet_dir)
    plugins = kubelet / "plugins"
    try:
        sockets = PluginSockets.for_driver(
            DRIVER_NAME, registry=kubelet / "plugins_registry", plugins=plugins
        )
        # In a pod: the service account's in-cluster credentials.
        client = AsyncClient() if client_factory is None else client_factory()
    except (SocketError, ConfigError) as exc:
        raise StartupError(f"--kubelet-plugin: {exc}") from exc
    try:
        async with trio.open_nursery() as nursery:
            claims_dir = plugins / DRIVER_NAME / "claims"
            driver = KubeDriver(
                supervisor,
                HoldSockets(app, http, nursery, plugins / DRIVER_NAME / ".sockets"),
                claims_dir=claims_dir,
                shared_gpus=config.kube_shared_gpus,
                dev_root=Path(config.dev_root),
            )
            driver.restore()
            preparer = ClaimPreparer(
                client,
                node=config.kube_node_name,
                claims_dir=claims_dir,
                reserve=driver.reserve,
                release=driver.release,
                cdi_dir=Path(config.cdi_dir),
            )
            publisher = SlicePublisher(client, config.kube_node_name, driver.devices, now=_now)
            sockets.service.parent.mkdir(parents=True, exist_ok=True)
            sockets.registration.parent.mkdir(parents=True, exist_ok=True)
            await nursery.start(
                functools.partial(
                    serve_plugin,
                    sockets,
                    preparer,
                    health=driver.health,
                    pool=config.kube_node_name,
                )
            )
            nursery.start_soon(_publish_forever, publisher)
            task_status.started(driver)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await client.close()
