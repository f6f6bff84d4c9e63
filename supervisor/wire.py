"""Wire types of invocations: what the scheduler submits and what it reads back.

All are msgspec Structs (frozen, kw_only, forbid_unknown_fields, snake_case);
their JSON Schemas are checked in under api/contracts/.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal

import msgspec

from machine.lanes import Isolation, Requirement

__all__ = [
    "INVOCATION_ID",
    "INVOCATION_ID_PATTERN",
    "LABEL_KEY",
    "LABEL_KEY_PATTERN",
    "LANE_ID",
    "MAX_BATCH",
    "MAX_COMMAND_ARGS",
    "MAX_COMMAND_CHARS",
    "MAX_LABELS",
    "MAX_LABEL_VALUE",
    "MAX_WAIT_S",
    "BatchItem",
    "BatchItemError",
    "BatchReply",
    "BatchRequest",
    "BuiltinWork",
    "Command",
    "EventKind",
    "GrantedLane",
    "GuestNetwork",
    "InvocationList",
    "InvocationRequest",
    "InvocationState",
    "InvocationStatus",
    "NodeEvent",
    "ProcessWork",
    "Resources",
    "SubmitResponse",
    "WaitReply",
    "WaitRequest",
]

# Ids reach paths, logs and cgroup names: a tight alphabet, checked before anything else.
INVOCATION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
INVOCATION_ID = re.compile(INVOCATION_ID_PATTERN)
# A lane's id as `machine.lanes` makes it.
LANE_ID = re.compile(r"^lane_[0-9a-f]{16}$")
InvocationId = Annotated[str, msgspec.Meta(pattern=INVOCATION_ID_PATTERN)]
MAX_TIMEOUT_S = 7 * 24 * 3600.0
_Arg = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=2**53)]

# Labels: a small map the scheduler sets to find its invocations again (the list
# filters by them); bounded, as everything kept per invocation is.
LABEL_KEY_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
LABEL_KEY = re.compile(LABEL_KEY_PATTERN)
MAX_LABELS = 16
MAX_LABEL_VALUE = 256
_LabelKey = Annotated[str, msgspec.Meta(pattern=LABEL_KEY_PATTERN)]
_LabelValue = Annotated[str, msgspec.Meta(max_length=MAX_LABEL_VALUE)]
Labels = Annotated[
    dict[_LabelKey, _LabelValue],
    msgspec.Meta(
        max_length=MAX_LABELS,
        description=(
            f"At most {MAX_LABELS} labels: keys lowercase letters, digits and `_.-`"
            f" (63 at most), values at most {MAX_LABEL_VALUE} characters, no control"
            " characters. `GET /v1/invocations?label=key=value` lists by them."
        ),
    ),
]
# What a status shows of a process's argv: enough to tell invocations apart, bounded.
MAX_COMMAND_ARGS = 16
MAX_COMMAND_CHARS = 1024


class InvocationState(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    timed_out = "timed_out"
    rejected = "rejected"


class GuestNetwork(StrEnum):
    """A guest's network: `none`, a namespace of its own with loopback only (it reaches
    the node through its Unix socket), or the `host`'s, where the operator allows it."""

    NONE = "none"
    HOST = "host"


class ProcessWork(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag="process",
    tag_field="kind",
):
    argv: Annotated[list[_Arg], msgspec.Meta(min_length=1, max_length=256)]
    env: Annotated[dict[str, str], msgspec.Meta(max_length=64)] = msgspec.field(
        default_factory=dict
    )
    cwd: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | None = None
    # `host` is refused (422 host_network_not_allowed) unless --guest-host-network.
    network: GuestNetwork = GuestNetwork.NONE


class BuiltinWork(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag="builtin",
    tag_field="kind",
):
    name: Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_]{0,63}$")]
    args: dict[str, Any] = msgspec.field(default_factory=dict)


class Resources(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    cpu_millis: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 100
    memory_bytes: _Count = 512 * 2**20
    gpus: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    vram_bytes: _Count = 0


class InvocationRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    id: InvocationId
    work: ProcessWork | BuiltinWork
    requirement: Requirement = Requirement.AUTO
    resources: Resources = Resources()
    isolation: Isolation = Isolation.SHARED
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_TIMEOUT_S)] = 3600.0
    # Last, and left out of the request's digest while empty (remembered.request_digest):
    # a request without labels hashes as it did before they existed.
    labels: Labels = msgspec.field(default_factory=dict)


class Command(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What an invocation runs, to tell it apart: a process's argv, bounded (the first
    16 arguments and 1,024 characters in all: an argument cut short ends with "…",
    `argc` counts them all and `argv_cut` says some were cut or left out), never its
    environment; or a builtin's name, never its args."""

    kind: Literal["process", "builtin"]
    argv: list[str] = msgspec.field(default_factory=list)
    argc: int = 0
    argv_cut: bool = False
    name: str | None = None


class GrantedLane(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    lane_id: str
    kind: str
    vram_bytes: int


class Usage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a process invocation used, from its cgroup's own counters."""

    cpu_seconds: float
    peak_memory_bytes: int | None = None
    oom_killed: bool = False
    pids_limit_hit: bool = False


class InvocationStatus(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    id: str
    state: InvocationState
    reason: str | None = None
    requirement: Requirement
    isolation: Isolation
    # What it runs and what it asked for, as submitted (None in records written before
    # they were kept, and for work a restart cut off).
    command: Command | None = None
    resources: Resources | None = None
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    lanes: list[GrantedLane]
    exit_code: int | None = None
    submitted_at: str
    started_at: str | None = None
    ended_at: str | None = None
    # Seconds from its start (or, if it never started, its submission) to its end, or
    # to now while it is live; by the wall clock, never below 0.
    duration_s: float | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    # Bytes written so far: a follower prints only what is new since its last read.
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    # Why its log files (GET .../logs) lack some of those bytes: a bound, or the disk.
    logs_cut: str | None = None
    # Process work run in a cgroup: known once the invocation's processes are gone.
    usage: Usage | None = None
    # The uid it ran as (its own, from --guest-uids); None for builtins or without a switch.
    uid: int | None = None
    # The network its guest got (`host` also where guests run unconfined); None for
    # builtins and before its guest started.
    network: GuestNetwork | None = None


class SubmitResponse(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The answer to a submission: the invocation and one capability token per lane."""

    id: str
    state: InvocationState
    lanes: list[GrantedLane]
    tokens: dict[str, str]  # lane_id -> capability token


# Invocation requests in one batch submission (and the 64 KiB body limit holds too).
MAX_BATCH = 256


class BatchRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    invocations: Annotated[
        list[InvocationRequest], msgspec.Meta(min_length=1, max_length=MAX_BATCH)
    ]


class BatchItemError(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The error envelope's body, as a single submission would have got it."""

    code: str
    message: str
    details: dict[str, Any] = msgspec.field(default_factory=dict)


class BatchItem(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One item's answer: `status` is what a single submission would have answered
    (202 with `accepted`, else the error and, for 429/503, `retry_after_s`)."""

    id: str
    status: int
    accepted: SubmitResponse | None = None
    error: BatchItemError | None = None
    retry_after_s: int | None = None


class BatchReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One item per request, in the order they were sent."""

    results: list[BatchItem]


# The longest a wait holds its request: below every client and proxy timeout we ship.
MAX_WAIT_S = 60.0


class WaitRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Wait until every one of `ids` has ended (or, with `any`, the first), at most
    `timeout_s` seconds."""

    ids: Annotated[list[InvocationId], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]
    timeout_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_WAIT_S)] = 30.0
    any: bool = False


class WaitReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The statuses of those that ended, the ids still queued or running when the wait
    ran out, and the ids this node does not know."""

    ended: list[InvocationStatus]
    pending: list[str]
    unknown: list[str]


class InvocationList(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One page of invocations, newest first; `next_cursor` fetches the next page
    (null on the last one)."""

    invocations: list[InvocationStatus]
    next_cursor: str | None = None


class EventKind(StrEnum):
    invocation = "invocation"
    health = "health"
    lane = "lane"
    admission = "admission"
    node = "node"


class NodeEvent(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One state change, as the events stream and the status page see it."""

    kind: EventKind
    at: str
    invocation: InvocationStatus | None = None
    device_id: str | None = None
    lane_id: str | None = None
    from_state: str | None = None
    to_state: str | None = None
    reasons: list[str] = msgspec.field(default_factory=list)
