"""The DRA health stream (`v1alpha1.DRAResourceHealth/NodeWatchResources`): kubelet
keeps one open per driver and puts what it says into the status of the pods whose
claims hold the devices (`status.allocatedResourcesStatus`).

Each message is every device of the pool: at once when the stream opens, then whenever
a device's health or reason changes (read from trio every HEALTH_POLL_SECONDS) and at
least every RESEND_SECONDS, well inside the timeout each reading carries, so a device
is called Unknown only when the node stopped saying anything. A stream holds a grpc
thread for as long as it is open: at most MAX_STREAMS at once, others are refused.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import trio

from kubeplugin.contracts import dra_health_pb2, dra_health_pb2_grpc

__all__ = [
    "HEALTH_SERVICE",
    "HEALTH_TIMEOUT_SECONDS",
    "MAX_STREAMS",
    "DeviceHealthReading",
    "HealthService",
]

log = logging.getLogger(__name__)

# The registration's name for this service (its full gRPC service name).
HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"
HEALTH_TIMEOUT_SECONDS = 60
RESEND_SECONDS = 20.0
HEALTH_POLL_SECONDS = 1.0
MAX_STREAMS = 2
_MESSAGE_CHARS = 1024


@dataclass(frozen=True)
class DeviceHealthReading:
    device: str
    healthy: bool
    message: str = ""


class HealthService(dra_health_pb2_grpc.DRAResourceHealthServicer):
    def __init__(
        self,
        pool: str,
        readings: Callable[[], Sequence[DeviceHealthReading]],
        token: trio.lowlevel.TrioToken,
        *,
        poll_seconds: float = HEALTH_POLL_SECONDS,
    ) -> None:
        self._pool = pool
        self._readings = readings
        self._token = token
        self._poll = poll_seconds
        self._streams = threading.BoundedSemaphore(MAX_STREAMS)

    def NodeWatchResources(self, request: Any, context: Any) -> Iterator[Any]:
        if not self._streams.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_STREAMS} streams are open")
        try:
            yield from self._watch(context)
        finally:
            self._streams.release()

    def _watch(self, context: Any) -> Iterator[Any]:
        ended = threading.Event()
        context.add_callback(ended.set)  # the stream's end, or the server's stop
        last: tuple[DeviceHealthReading, ...] | None = None
        sent_at = 0.0
        while not ended.is_set():
            try:
                found = tuple(trio.from_thread.run_sync(self._readings, trio_token=self._token))
            except trio.RunFinishedError:
                return  # the node is stopping
            now = time.time()
            if found != last or now - sent_at >= RESEND_SECONDS:
                yield self._message(found, int(now))
                last, sent_at = found, now
            ended.wait(self._poll)

    def _message(self, readings: Sequence[DeviceHealthReading], now: int) -> Any:
        reply = dra_health_pb2.NodeWatchResourcesResponse()
        for reading in readings:
            reply.devices.add(
                device=dra_health_pb2.DeviceIdentifier(
                    pool_name=self._pool, device_name=reading.device
                ),
                health=dra_health_pb2.HEALTHY if reading.healthy else dra_health_pb2.UNHEALTHY,
                last_updated_time=now,
                health_check_timeout_seconds=HEALTH_TIMEOUT_SECONDS,
                message=reading.message[:_MESSAGE_CHARS],
            )
        return reply
