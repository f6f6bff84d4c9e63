"""Preparing and unpreparing claims on this node: the `ClaimHandler` kubelet's calls
reach (`kubeplugin.server`).

Prepare, per claim: the claim is read from the API server and checked (`claims.py`);
the node reserves what it was allocated and mints its tokens (`reserve`, the node's own
ledger and journal, so a restart keeps it; and its socket in the claim's folder); the
tokens go into the claim's own folder (0755 in the claims' 0700 folder, the token file
0444 and written whole), which the claim's CDI spec mounts in its pods (`cdi.py`); the
answer names each allocated device with the claim's CDI device id.
Every step is idempotent: kubelet calls Prepare again after its own restart and after a
reboot (the CDI folder is a tmpfs), and the files are written again.

Unprepare, per claim: the node releases it (`release`, its tokens revoked; a claim it
does not hold is fine: kubelet repeats Unprepare, and the claim may be long deleted),
then its folder and spec go.

A claim that fails any step gets its own typed error and leaves nothing behind.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio
from lightkube import AsyncClient

from kubeplugin.cdi import (
    CDI_DIR,
    CdiError,
    Passthrough,
    claim_device_id,
    remove_claim_spec,
    write_claim_spec,
)
from kubeplugin.claims import ClaimPlan, ClaimRefused, plan_claim, read_claim
from kubeplugin.files import claim_folder, remove_folder, write_tokens
from kubeplugin.server import ClaimRef, ClaimResult, PreparedDevice
from kubeplugin.sockets import DRIVER_NAME

__all__ = ["CLAIM_SECONDS", "ClaimPreparer", "Granted"]

log = logging.getLogger(__name__)

# One claim's Prepare, inside the batch's own bound (kubeplugin.server.CALL_SECONDS).
CLAIM_SECONDS = 20.0


@dataclass(frozen=True)
class Granted:
    """What the node holds for a claim: its lanes and a token for each, in order, and
    whether this call reserved them (False: held already, a repeated Prepare)."""

    lane_ids: tuple[str, ...]
    tokens: tuple[str, ...]
    new: bool
    passthrough: Passthrough = field(default_factory=Passthrough)


class ClaimPreparer:
    """`reserve(plan)`: what the node holds for the claim (ClaimRefused when it cannot).
    `release(claim_uid)`: idempotent."""

    def __init__(
        self,
        client: AsyncClient,
        *,
        node: str,
        claims_dir: Path,
        reserve: Callable[[ClaimPlan], Awaitable[Granted]],
        release: Callable[[str], Awaitable[None]],
        cdi_dir: Path = CDI_DIR,
        driver: str = DRIVER_NAME,
    ) -> None:
        self._client = client
        self._node = node
        self._claims_dir = claims_dir
        self._reserve = reserve
        self._release = release
        self._cdi_dir = cdi_dir
        self._driver = driver

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, ClaimResult]:
        """Each claim at once, each bounded on its own: one slow or failing claim
        answers for itself, and the others' answers stand."""
        answers: dict[str, ClaimResult] = {}

        async def one(claim: ClaimRef) -> None:
            with trio.move_on_after(CLAIM_SECONDS):
                answers[claim.uid] = await self._guarded_prepare(claim)
                return
            answers[claim.uid] = ClaimResult(error=f"prepare_timeout: over {CLAIM_SECONDS:g} s")

        async with trio.open_nursery() as nursery:
            for claim in claims:
                nursery.start_soon(one, claim)
        return answers

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        return {claim.uid: await self._unprepare_one(claim) for claim in claims}

    async def _guarded_prepare(self, claim: ClaimRef) -> ClaimResult:
        try:
            return await self._prepare_one(claim)
        except Exception as exc:  # the node's own failure: this claim's answer, not all
            log.exception("claim %s: not prepared", claim.uid)
            return ClaimResult(error=f"prepare_failed: {type(exc).__name__}: {exc}"[:500])

    async def _prepare_one(self, claim: ClaimRef) -> ClaimResult:
        try:
            plan = plan_claim(claim, await read_claim(self._client, claim), node=self._node)
            device_id = claim_device_id(claim.uid, self._driver)  # refuses an odd uid first
        except ClaimRefused as refused:
            return ClaimResult(error=str(refused))
        except CdiError as exc:
            return ClaimResult(error=f"claim_malformed: {exc}")
        try:
            granted = await self._reserve(plan)
        except ClaimRefused as refused:
            return ClaimResult(error=str(refused))
        try:
            folder = self.folder(claim.uid)
            write_tokens(folder, granted.tokens)
            write_claim_spec(
                claim.uid,
                folder,
                granted.lane_ids,
                passthrough=granted.passthrough,
                cdi_dir=self._cdi_dir,
                driver=self._driver,
            )
        except OSError as exc:
            log.error("claim %s: not prepared: %s", claim.uid, exc)
            if granted.new:  # a claim prepared before keeps what its running pods use
                try:
                    await self._remove_files(claim.uid)
                finally:
                    await self._release(claim.uid)
            return ClaimResult(error=f"prepare_failed: {exc}")
        devices = tuple(
            PreparedDevice(
                pool_name=self._node,
                device_name=device.device,
                request_names=(device.request,),
                cdi_device_ids=(device_id,),
                share_id=device.share_id,
            )
            for device in plan.devices
        )
        return ClaimResult(devices=devices)

    async def _unprepare_one(self, claim: ClaimRef) -> str:
        try:
            await self._release(claim.uid)
            await self._remove_files(claim.uid)
        except ClaimRefused as refused:  # still held: kubelet asks again
            return f"unprepare_failed: {refused}"
        except (OSError, CdiError) as exc:
            return f"unprepare_failed: {exc}"
        return ""

    def folder(self, claim_uid: str) -> Path:
        """The claim's folder, made if it is not there (`kubeplugin.files.claim_folder`)."""
        claim_device_id(claim_uid, self._driver)  # a uid that names a file, nothing more
        return claim_folder(self._claims_dir, claim_uid)

    async def _remove_files(self, claim_uid: str) -> None:
        """Its spec, then its folder, off the event loop: its pods may have filled it."""
        remove_claim_spec(claim_uid, cdi_dir=self._cdi_dir, driver=self._driver)
        claim_device_id(claim_uid, self._driver)
        await trio.to_thread.run_sync(remove_folder, self._claims_dir / claim_uid)
