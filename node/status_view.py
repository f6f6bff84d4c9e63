"""The human tables of `status` and `ls` (their `--json` prints the wire types instead)."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence, Sized
from typing import Protocol

from api.wire import NodeStatus
from machine.snapshot import Amounts, NodeSnapshot
from supervisor.wire import Command, InvocationState, InvocationStatus

__all__ = ["command_text", "duration", "gpu_summary", "invocation_table", "status_text", "table"]

# The COMMAND column's width; `ls --json` has the whole (bounded) argv.
COMMAND_COLUMN = 60

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart, one line per row."""
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    ]
    return "\n".join(lines) + "\n"


def size(count: int) -> str:
    value = float(count)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


def cores(millis: int) -> str:
    return f"{millis / 1000:g}"


class _Gpu(Protocol):
    """A physical GPU as discovery (`GpuDevice`) and the snapshot (`DeviceSection`) have it."""

    @property
    def mig_instances(self) -> Sized: ...


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def gpu_summary(gpus: Sequence[_Gpu]) -> str:
    """The node's GPUs in words, the same for `dev`'s banner and `status`: physical GPUs,
    and the MIG instances some are split into, e.g. "2 GPUs (3 MIG instances)". (Capacity
    counts lanes instead: a whole GPU is one, each MIG instance another.)"""
    text = _counted(len(gpus), "GPU")
    migs = sum(len(gpu.mig_instances) for gpu in gpus)
    return f"{text} ({_counted(migs, 'MIG instance')})" if migs else text


def _row(name: str, amounts: Amounts, show: Callable[[int], str]) -> list[str]:
    return [
        name,
        show(amounts.capacity),
        show(amounts.reserved),
        show(amounts.allocated),
        show(amounts.allocatable),
    ]


def status_text(node: NodeStatus, snapshot: NodeSnapshot) -> str:
    readiness = "ready" if node.ready else "NOT READY"
    drained = ", DRAINED (admits no new work)" if node.drained else ""
    out = [f"node {node.node_id}: {readiness}{drained}\n"]
    out += [f"  {key}: {why}\n" for key, why in sorted(node.readiness_reasons.items())]
    out += [f"devices: {gpu_summary(snapshot.devices)}\n"]
    capacity = snapshot.capacity
    rows = [
        _row("cpu (cores)", capacity.cpu_millis, cores),
        _row("memory", capacity.memory_bytes, size),
        # A request's `gpus` counts lanes: a whole GPU, or one MIG instance.
        _row("gpu lanes", capacity.gpus, str),
    ]
    rows += [
        [f"vram {v.lane_id}", size(v.capacity), size(v.reserved), size(v.allocated),
         size(v.allocatable)]
        for v in capacity.vram_bytes
    ]  # fmt: skip
    out += ["\n", table(["RESOURCE", "TOTAL", "RESERVED", "ALLOCATED", "FREE"], rows)]
    lanes = [
        [lane.lane_id, lane.kind.value, lane.mig_uuid or lane.device_id, lane.health.value,
         "drained" if lane.drained else "-"]
        for lane in snapshot.lanes
    ]  # fmt: skip
    out += ["\n", table(["LANE", "KIND", "DEVICE", "HEALTH", "DRAIN"], lanes)]
    counts = [[state.value, str(node.invocations.get(state.value, 0))] for state in InvocationState]
    out += ["\n", table(["INVOCATIONS", "COUNT"], counts)]
    return "".join(out)


def _printable(text: str) -> str:
    """`text` on one line: control characters (a newline in `sh -c` scripts) escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def command_text(command: Command | None, width: int = COMMAND_COLUMN) -> str:
    """A command on one line of at most `width` characters: the argv as a shell would
    read it ("…" where it was cut), or `builtin:NAME`; "-" when the status has none."""
    if command is None:
        return "-"
    if command.kind == "builtin":
        text = f"builtin:{command.name}"
    else:
        text = " ".join(_printable(shlex.quote(arg)) for arg in command.argv)
        if command.argc > len(command.argv):
            text += " …"
    return text if len(text) <= width else text[: width - 1] + "…"


def duration(seconds: float | None) -> str:
    """`0.25s`, `42.0s`, `3m04s`, `2h05m`; "-" when unknown."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.2f}s"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def invocation_table(invocations: Sequence[InvocationStatus]) -> str:
    """One row per invocation; COMMAND last, as it holds spaces."""
    rows = [
        [inv.id, inv.state.value, inv.reason or "-",
         "-" if inv.exit_code is None else str(inv.exit_code),
         duration(inv.duration_s),
         ",".join(f"{lane.kind}:{lane.lane_id}" for lane in inv.lanes) or "-",
         inv.submitted_at, command_text(inv.command)]
        for inv in invocations
    ]  # fmt: skip
    header = ["ID", "STATE", "REASON", "EXIT", "DURATION", "LANES", "SUBMITTED", "COMMAND"]
    return table(header, rows)
