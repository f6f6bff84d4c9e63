"""The kubelet plugin: the registration service kubelet finds on its registry socket and
the DRA node service it dials, served with grpcio on Unix sockets and bridged into trio.

grpcio serves each call on a thread of its own pool. `GetInfo`, which kubelet also polls
for liveness, is answered on that thread at once. `NodePrepareResources` and
`NodeUnprepareResources` are handed to trio (`trio.from_thread`), one batch at a time
(kubelet's own helper serializes them too), each bounded well inside kubelet's 45 s per
call. Every claim of a request gets its own entry in the answer: what the handler said,
or a typed error (`prepare_timeout`, `prepare_failed`, `no_answer`, `plugin_stopping`),
never a failed call, which kubelet would take as no answer for every claim.

The DRA service starts before the registration socket appears (kubelet dials the
endpoint as soon as it has registered the plugin), and the registration socket goes
first at the end. Only this plugin's own two sockets are ever created or removed. A
registration socket that disappears (its folder cleaned) is served again within
REGISTRATION_CHECK_SECONDS, and kubelet registers the plugin anew.

Given a health source, the node service's socket serves the health stream too
(`kubeplugin.health`), and the registration advertises it.
"""

from __future__ import annotations

import functools
import logging
import stat
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
import trio

from kubeplugin.contracts import (
    dra_health_pb2_grpc,
    dra_pb2,
    dra_pb2_grpc,
    registration_pb2,
    registration_pb2_grpc,
)
from kubeplugin.health import HEALTH_SERVICE, MAX_STREAMS, DeviceHealthReading, HealthService
from kubeplugin.sockets import DRIVER_NAME, PluginSockets

__all__ = [
    "CALL_SECONDS",
    "V1BETA1_SERVICE",
    "ClaimHandler",
    "ClaimRef",
    "ClaimResult",
    "PreparedDevice",
    "RegistrationState",
    "serve_plugin",
]

log = logging.getLogger(__name__)

# Kubelet gives every call 45 s; an answer (an error one included) comes well before.
CALL_SECONDS = 30.0
# Calls in flight at once: GetInfo is answered while Prepare calls wait for trio, and
# each open health stream holds one thread of its own.
_WORKERS = 4 + MAX_STREAMS
# kubelet's plugin type for DRA drivers, and the node service version this plugin serves.
_PLUGIN_TYPE = "DRAPlugin"
_SUPPORTED = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
# The node service's name as 1.32 and 1.33 kubelets call it (pkg/apis/dra/v1beta1).
V1BETA1_SERVICE = "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
# How often the registration socket is looked for: one deleted (kubelet's folder
# cleaned, say) is served again, and kubelet registers the plugin anew.
REGISTRATION_CHECK_SECONDS = 5.0
# At the end: how long calls in flight get, and the whole stop.
_STOP_GRACE_SECONDS = 5.0
_STOP_SECONDS = 10.0
_T = TypeVar("_T")


@dataclass(frozen=True)
class ClaimRef:
    """A ResourceClaim as kubelet names it: all the request carries."""

    namespace: str
    uid: str
    name: str


@dataclass(frozen=True)
class PreparedDevice:
    """One allocated device made ready for the claim's pods, and its CDI device ids."""

    pool_name: str
    device_name: str
    request_names: tuple[str, ...] = ()
    cdi_device_ids: tuple[str, ...] = ()
    share_id: str | None = None


@dataclass(frozen=True)
class ClaimResult:
    """A claim's answer: its devices, or why it could not be prepared ("" for none)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class ClaimHandler(Protocol):
    """The trio side: what preparing and unpreparing claims means on this node. Each
    answers per claim UID; a claim left out is answered `no_answer`."""

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, ClaimResult]: ...

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]: ...


@dataclass
class RegistrationState:
    """What kubelet last said of the registration (NotifyRegistrationStatus)."""

    registered: bool = False
    error: str = ""
    notified: int = 0


class _Registration(registration_pb2_grpc.RegistrationServicer):
    def __init__(
        self, driver: str, endpoint: Path, state: RegistrationState, *, health: bool
    ) -> None:
        versions = (*_SUPPORTED, HEALTH_SERVICE) if health else _SUPPORTED
        self._info = registration_pb2.PluginInfo(
            type=_PLUGIN_TYPE, name=driver, endpoint=str(endpoint), supported_versions=versions
        )
        self._state = state

    def GetInfo(self, request: Any, context: Any) -> Any:
        return self._info

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        state = self._state
        state.registered, state.error = request.plugin_registered, request.error
        state.notified += 1
        if request.plugin_registered:
            log.info("kubelet registered the DRA plugin")
        else:
            log.error("kubelet refused the DRA plugin: %s", request.error)
        return registration_pb2.RegistrationStatusResponse()


class _Bridge:
    """Hands a batch of claims to trio, one batch at a time, bounded."""

    def __init__(self, token: trio.lowlevel.TrioToken, seconds: float) -> None:
        self._token = token
        self._seconds = seconds
        self._lock = trio.Lock()

    def call(
        self,
        what: str,
        job: Callable[[Sequence[ClaimRef]], Awaitable[Mapping[str, _T]]],
        claims: Sequence[ClaimRef],
        failed: Callable[[str], _T],
    ) -> dict[str, _T]:
        """Per claim UID: what `job` answered, else `failed(why)`. Runs on a grpc thread."""
        try:
            answered = dict(
                trio.from_thread.run(self._bounded, job, claims, trio_token=self._token)
            )
        except trio.TooSlowError:
            return {
                c.uid: failed(f"{what}_timeout: no answer in {self._seconds:g} s") for c in claims
            }
        except (trio.RunFinishedError, trio.Cancelled):
            return {c.uid: failed("plugin_stopping: the node is stopping") for c in claims}
        except Exception as exc:
            log.exception("DRA %s of %d claims failed", what, len(claims))
            return {
                c.uid: failed(f"{what}_failed: {type(exc).__name__}: {exc}"[:500]) for c in claims
            }
        missing = failed(f"no_answer: the node said nothing of this claim at {what}")
        return {c.uid: answered.get(c.uid, missing) for c in claims}

    async def _bounded(
        self,
        job: Callable[[Sequence[ClaimRef]], Awaitable[Mapping[str, _T]]],
        claims: Sequence[ClaimRef],
    ) -> Mapping[str, _T]:
        with trio.fail_after(self._seconds):
            async with self._lock:
                return await job(claims)


def _claims(request: Any) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]


class _NodeService(dra_pb2_grpc.DRAPluginServicer):
    def __init__(self, handler: ClaimHandler, bridge: _Bridge) -> None:
        self._handler = handler
        self._bridge = bridge

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        answers = self._bridge.call(
            "prepare", self._handler.prepare, _claims(request), lambda why: ClaimResult(error=why)
        )
        reply = dra_pb2.NodePrepareResourcesResponse()
        for uid, result in answers.items():
            entry = reply.claims[uid]
            entry.error = result.error
            for device in result.devices:
                added = entry.devices.add(
                    pool_name=device.pool_name,
                    device_name=device.device_name,
                    request_names=device.request_names,
                    cdi_device_ids=device.cdi_device_ids,
                )
                if device.share_id is not None:
                    added.share_id = device.share_id
        return reply

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        answers = self._bridge.call(
            "unprepare", self._handler.unprepare, _claims(request), lambda why: why
        )
        reply = dra_pb2.NodeUnprepareResourcesResponse()
        for uid, error in answers.items():
            reply.claims[uid].error = error
        return reply


def _v1beta1(node: _NodeService) -> grpc.GenericRpcHandler:
    """The same service for a 1.32 or 1.33 kubelet, at v1beta1's method paths: its
    messages are v1's, wire for wire, so v1's are read and written there."""

    def method(call: Callable[[Any, Any], Any], asked: Any, answer: Any) -> Any:
        return grpc.unary_unary_rpc_method_handler(
            call,
            request_deserializer=asked.FromString,
            response_serializer=answer.SerializeToString,
        )

    return grpc.method_handlers_generic_handler(
        V1BETA1_SERVICE,
        {
            "NodePrepareResources": method(
                node.NodePrepareResources,
                dra_pb2.NodePrepareResourcesRequest,
                dra_pb2.NodePrepareResourcesResponse,
            ),
            "NodeUnprepareResources": method(
                node.NodeUnprepareResources,
                dra_pb2.NodeUnprepareResourcesRequest,
                dra_pb2.NodeUnprepareResourcesResponse,
            ),
        },
    )


def _remove_own_socket(path: Path) -> None:
    """A socket this plugin left (a crash): removed. Anything else there is refused."""
    try:
        found = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(found.st_mode):
        raise OSError(f"{path}: exists and is not a socket")
    path.unlink()


def _add_node_service(
    node: _NodeService, health: HealthService | None, server: grpc.Server
) -> None:
    dra_pb2_grpc.add_DRAPluginServicer_to_server(node, server)  # type: ignore[no-untyped-call]
    server.add_generic_rpc_handlers((_v1beta1(node),))
    if health is not None:
        dra_health_pb2_grpc.add_DRAResourceHealthServicer_to_server(  # type: ignore[no-untyped-call]
            health, server
        )


def _add_registration(registration: _Registration, server: grpc.Server) -> None:
    registration_pb2_grpc.add_RegistrationServicer_to_server(  # type: ignore[no-untyped-call]
        registration, server
    )


def _stop(server: grpc.Server) -> None:
    server.stop(_STOP_GRACE_SECONDS).wait()


def _server(bind: Path, add: Callable[[grpc.Server], None]) -> grpc.Server:
    bind.parent.mkdir(parents=True, exist_ok=True)
    _remove_own_socket(bind)
    server = grpc.server(ThreadPoolExecutor(max_workers=_WORKERS))
    add(server)
    if server.add_insecure_port(f"unix://{bind}") == 0:
        raise OSError(f"cannot serve on {bind}")
    return server


async def serve_plugin(
    sockets: PluginSockets,
    handler: ClaimHandler,
    *,
    driver: str = DRIVER_NAME,
    state: RegistrationState | None = None,
    call_seconds: float = CALL_SECONDS,
    health: Callable[[], Sequence[DeviceHealthReading]] | None = None,
    pool: str = "",
    task_status: trio.TaskStatus[RegistrationState] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the DRA node service (and, given `health`, the health stream of the pool
    `pool`), then the registration socket, until cancelled; then stop both (shielded,
    bounded) and remove their sockets."""
    state = RegistrationState() if state is None else state
    token = trio.lowlevel.current_trio_token()
    bridge = _Bridge(token, call_seconds)
    watch = None if health is None else HealthService(pool, health, token)
    started: list[tuple[grpc.Server, Path]] = []
    try:
        node = _NodeService(handler, bridge)
        dra = await trio.to_thread.run_sync(
            _server, sockets.service, functools.partial(_add_node_service, node, watch)
        )
        started.append((dra, sockets.service))
        await trio.to_thread.run_sync(dra.start)
        reg = _Registration(driver, sockets.service, state, health=watch is not None)
        first = True
        while True:
            registration = await trio.to_thread.run_sync(
                _server, sockets.registration, functools.partial(_add_registration, reg)
            )
            started.append((registration, sockets.registration))
            await trio.to_thread.run_sync(registration.start)
            if first:
                task_status.started(state)
                first = False
            else:
                log.warning("the registration socket was gone: served again")
            while sockets.registration.is_socket():  # noqa: ASYNC110 - a file, polled
                await trio.sleep(REGISTRATION_CHECK_SECONDS)
            with trio.move_on_after(_STOP_SECONDS, shield=True):
                await trio.to_thread.run_sync(_stop, registration)
            started.remove((registration, sockets.registration))
    finally:
        with trio.move_on_after(_STOP_SECONDS, shield=True):
            for server, path in reversed(started):  # the registration socket first
                await trio.to_thread.run_sync(_stop, server)
                _remove_own_socket(path)
