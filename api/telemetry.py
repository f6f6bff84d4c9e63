"""Telemetry push: POST the current snapshot to the scheduler.

Every `interval`, and at once when `nudge()` is called (a health change), the
pusher encodes the snapshot *as it is at send time*: only the latest state is
ever pending, so a dead scheduler builds no backlog. Each request has its own
deadline; failures back off exponentially with full jitter, capped, and a
nudge never bypasses the backoff. The pusher runs in its own task, so a slow
or dead scheduler never slows the daemon.

With `sign` (the daemon always gives one), every attempt carries a fresh
signature of the exact body in the `Litegraph-Signature` header (a new nonce
and window each time; see `capabilities.push_signature` and
docs/telemetry.md), so the scheduler can tell this node from an impostor.
With `bearer`, every attempt also carries `Authorization: Bearer <bearer>`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import httpx
import trio

from capabilities.push_signature import SIGNATURE_HEADER

__all__ = ["TelemetryPusher"]

log = logging.getLogger(__name__)


class TelemetryPusher:
    def __init__(
        self,
        url: str,
        interval: float,
        snapshot: Callable[[], bytes],
        *,
        node_id: str,
        sign: Callable[[bytes], str] | None = None,
        bearer: str | None = None,
        request_timeout: float = 5.0,
        max_backoff: float = 60.0,
        rng: random.Random | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url
        self.interval = interval
        self._snapshot = snapshot
        self._node_id = node_id
        self._sign = sign
        self._bearer = bearer
        self._timeout = request_timeout
        self._max_backoff = max_backoff
        self._rng = rng or random.Random()  # noqa: S311 -- jitter, not a secret
        self._transport = transport
        self._wake = trio.Event()
        self.sent = 0
        self.failures = 0
        self.consecutive_failures = 0

    def nudge(self) -> None:
        """Push soon: something the scheduler must know (health) changed."""
        self._wake.set()

    def _backoff(self) -> float:
        ceiling = min(self._max_backoff, self.interval * 2 ** min(self.consecutive_failures, 16))
        return self._rng.uniform(0, ceiling)

    async def _push_once(self, client: httpx.AsyncClient) -> bool:
        body = self._snapshot()
        headers = {"content-type": "application/json", "x-node-id": self._node_id}
        if self._sign is not None:
            headers[SIGNATURE_HEADER] = self._sign(body)
        if self._bearer is not None:
            headers["authorization"] = f"Bearer {self._bearer}"
        try:
            with trio.fail_after(self._timeout):
                reply = await client.post(self.url, content=body, headers=headers)
            if reply.status_code >= 300:
                raise httpx.HTTPStatusError("push refused", request=reply.request, response=reply)
        except (trio.TooSlowError, httpx.HTTPError) as exc:
            self.failures += 1
            self.consecutive_failures += 1
            log.warning("telemetry push to %s failed: %s", self.url, exc or type(exc).__name__)
            return False
        self.sent += 1
        self.consecutive_failures = 0
        return True

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        timeout = httpx.Timeout(self._timeout)
        async with httpx.AsyncClient(timeout=timeout, transport=self._transport) as client:
            task_status.started()
            while True:
                ok = await self._push_once(client)
                wait = self.interval if ok else self._backoff()
                earliest = trio.current_time() + (0 if ok else wait)
                with trio.move_on_after(wait):
                    await self._wake.wait()
                self._wake = trio.Event()
                # A nudge during backoff waits for the backoff to end.
                await trio.sleep_until(max(earliest, trio.current_time()))
