"""A lane's device state: its buffers, its budget, and the answer to each request.

`LaneState.handle` is the whole host minus the pipes: it takes one decoded
request and returns its reply, and a refused request changes nothing.

The budget is honest device memory: what the backend holds for itself (its
CUDA context, measured at start: `Backend.overhead`) is reserved out of it, the
memory pool is limited to the rest, a kernel's temporaries must fit in what is
free before it runs, and freed blocks go back to the device at once. A sticky
device error, in any request, is that request's `device_failed`, after which
`failed` is set and the host exits (`lanehost.host.serve`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from lanehost.backend import Backend
from lanehost.kernels import Kernel, KernelError
from lanehost.protocol import (
    ITEMSIZE,
    MAX_BUFFERS,
    PROTOCOL_VERSION,
    Alloc,
    AllocReply,
    ErrorCode,
    ErrorReply,
    Free,
    FreeAll,
    FreeAllReply,
    FreeReply,
    Hello,
    HelloReply,
    Read,
    ReadReply,
    Reply,
    Request,
    Run,
    RunReply,
    Stats,
    StatsReply,
    Write,
    WriteReply,
)

__all__ = ["LaneState", "Refused"]

log = logging.getLogger(__name__)


class Refused(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code


@dataclasses.dataclass(frozen=True)
class _Buffer:
    array: Any
    nbytes: int
    charged: int  # what it costs the budget: nbytes in the pool's blocks


class LaneState:
    def __init__(self, backend: Backend, memory_bytes: int, kernels: dict[str, Kernel]) -> None:
        self._backend = backend
        self._total = memory_bytes
        self._reserved = min(backend.overhead, memory_bytes)
        self._kernels = kernels
        self._buffers: dict[str, _Buffer] = {}
        self._used = 0
        self._greeted = False
        self.failed: str | None = None  # why the device can no longer be trusted
        # The pool never holds more than the budget leaves the buffers and temporaries.
        backend.limit(memory_bytes - self._reserved)

    @property
    def used(self) -> int:
        return self._used

    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def free(self) -> int:
        return max(0, self._total - self._reserved - self._used)

    def handle(self, request: Request) -> Reply:
        if self.failed is not None:
            return ErrorReply(id=request.id, code="device_failed", message=self.failed)
        try:
            if not self._greeted and not isinstance(request, Hello):
                raise Refused("bad_request", "the first request must be hello")
            return self._dispatch(request)
        except Refused as exc:
            return ErrorReply(id=request.id, code=exc.code, message=str(exc))
        except self._backend.device_errors as exc:
            # Sticky: the context is dead, every later call would fail too. Whatever
            # the request (run, alloc, write, read, free), it ends here, and the host
            # with it, so its owner starts a fresh one.
            op = type(request).__name__.lower()
            self.failed = f"{op}: the device failed and its context is lost: {exc!r}"
            log.error("%s", self.failed)
            return ErrorReply(id=request.id, code="device_failed", message=self.failed)

    def _dispatch(self, request: Request) -> Reply:
        match request:
            case Hello():
                return self._hello(request)
            case Alloc():
                return self._alloc(request)
            case Free():
                return FreeReply(id=request.id, nbytes=self._free(request.buffer_id))
            case FreeAll():
                return self._free_all(request)
            case Write():
                return self._write(request)
            case Read():
                buf, _ = self._span(request.buffer_id, request.offset, request.length)
                data = self._backend.read(buf.array, request.offset, request.length)
                return ReadReply(id=request.id, data=data)
            case Run():
                return self._run(request)
            case Stats():
                return StatsReply(
                    id=request.id,
                    used=self._used,
                    free=self.free,
                    total=self._total,
                    buffers=len(self._buffers),
                    reserved=self._reserved,
                )

    def _hello(self, request: Hello) -> HelloReply:
        if request.version != PROTOCOL_VERSION:
            raise Refused(
                "unsupported_version",
                f"this host speaks version {PROTOCOL_VERSION}, not {request.version}",
            )
        self._greeted = True
        return HelloReply(
            id=request.id,
            version=PROTOCOL_VERSION,
            backend=self._backend.name,
            device=self._backend.device,
            memory_total=self._total,
            kernels=sorted(self._kernels),
            memory_reserved=self._reserved,
        )

    def _alloc(self, request: Alloc) -> AllocReply:
        if request.buffer_id in self._buffers:
            raise Refused("bad_args", f"buffer {request.buffer_id} already exists")
        if len(self._buffers) >= MAX_BUFFERS:
            raise Refused("too_many_buffers", f"the lane holds {MAX_BUFFERS} buffers already")
        nbytes = math.prod(request.shape) * ITEMSIZE[request.dtype]
        charged = self._backend.charge(nbytes)
        if charged > self.free:
            raise Refused("out_of_memory", f"{nbytes} bytes asked, {self._free_text()}")
        try:
            array = self._backend.zeros(request.dtype, request.shape)
        except self._backend.out_of_memory as exc:
            raise Refused("out_of_memory", f"the device refused {nbytes} bytes: {exc}") from exc
        self._buffers[request.buffer_id] = _Buffer(array, nbytes, charged)
        self._used += charged
        return AllocReply(id=request.id, buffer_id=request.buffer_id, nbytes=nbytes)

    def _free_text(self) -> str:
        reserved = f" ({self._reserved} reserved by the host)" if self._reserved else ""
        return f"{self.free} of {self._total} free{reserved}"

    def _buffer(self, buffer_id: str) -> _Buffer:
        buf = self._buffers.get(buffer_id)
        if buf is None:
            raise Refused("unknown_buffer", f"no buffer {buffer_id}")
        return buf

    def _free(self, buffer_id: str) -> int:
        nbytes = self._drop(buffer_id)
        self._backend.release()
        return nbytes

    def _drop(self, buffer_id: str) -> int:
        buf = self._buffer(buffer_id)
        del self._buffers[buffer_id]
        self._used -= buf.charged
        return buf.nbytes

    def _free_all(self, request: FreeAll) -> FreeAllReply:
        freed = nbytes = 0
        for buffer_id in dict.fromkeys(request.buffer_ids):
            if buffer_id in self._buffers:
                nbytes += self._drop(buffer_id)
                freed += 1
        if freed:
            self._backend.release()
        return FreeAllReply(id=request.id, freed=freed, nbytes=nbytes)

    def _span(self, buffer_id: str, offset: int, length: int) -> tuple[_Buffer, int]:
        buf = self._buffer(buffer_id)
        end = offset + length
        if end > buf.nbytes:
            raise Refused(
                "out_of_range", f"bytes [{offset}, {end}) outside a buffer of {buf.nbytes}"
            )
        return buf, end

    def _write(self, request: Write) -> WriteReply:
        buf, _ = self._span(request.buffer_id, request.offset, len(request.data))
        self._backend.write(buf.array, request.offset, request.data)
        return WriteReply(id=request.id, nbytes=len(request.data))

    def _run(self, request: Run) -> RunReply:
        kernel = self._kernels.get(request.kernel)
        if kernel is None:
            raise Refused("unknown_kernel", f"no kernel {request.kernel!r}")
        arrays = {name: self._buffer(bid).array for name, bid in request.buffers.items()}
        backend = self._backend
        try:
            kernel.check(request.args, arrays)
        except KernelError as exc:
            raise Refused("bad_args", str(exc)) from exc
        scratch = self._backend.charge(kernel.scratch(arrays))
        if scratch > self.free:
            raise Refused(
                "out_of_memory",
                f"{request.kernel} needs {scratch} bytes of temporaries, {self._free_text()}",
            )
        try:
            result = kernel(backend.xp, request.args, arrays)
            backend.synchronize()
        except KernelError as exc:
            code = exc.code if exc.code in _KERNEL_CODES else "kernel_failed"
            raise Refused(code, str(exc)) from exc  # type: ignore[arg-type]
        except backend.out_of_memory as exc:  # past the pool's limit: the device refused
            raise Refused("out_of_memory", f"{request.kernel}: the device refused: {exc}") from exc
        except backend.device_errors:
            raise  # sticky: `handle` ends the host
        except Exception as exc:
            # The buffers it was given may be partly written; the others are untouched.
            log.exception("kernel %s failed", request.kernel)
            raise Refused("kernel_failed", f"{request.kernel}: {exc!r}") from exc
        finally:
            if scratch:
                backend.release()  # its temporaries' blocks go back to the device
        if not isinstance(result, dict) or not all(
            isinstance(k, str) and isinstance(v, bool | int | float) for k, v in result.items()
        ):
            raise Refused("kernel_failed", f"{request.kernel} returned a non-scalar result")
        return RunReply(id=request.id, result=result)


_KERNEL_CODES = frozenset({"bad_args", "dtype_mismatch", "shape_mismatch", "kernel_failed"})
