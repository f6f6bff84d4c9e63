"""An invocation's status says what it is: its command (bounded, never its environment),
the resources it asked for, its labels, its lanes and its duration; older journaled
statuses still decode; labels leave the digest of a label-less request as it was."""

from __future__ import annotations

import functools

import msgspec
import pytest
import trio

from machine.journal import EndedRecord
from supervisor.admission import AdmissionRefused, check_request
from supervisor.invocation import Invocation, command_of, duration_between
from supervisor.listing import Listed, ListQuery, page
from supervisor.remembered import recorded_status, request_digest
from supervisor.wire import (
    MAX_COMMAND_ARGS,
    MAX_COMMAND_CHARS,
    BuiltinWork,
    InvocationRequest,
    InvocationState,
    InvocationStatus,
    ProcessWork,
    Resources,
)

S = InvocationState

# Digests taken before `labels` existed: a request without labels must keep them, or
# every id submitted before an upgrade would be a 409 `id_conflict` after it.
PINNED = [
    (
        b'{"id":"pin-1","work":{"kind":"builtin","name":"sleep","args":{"seconds":5,"b":[1,2]}}}',
        "27bdbb34ad3975bb4c10f9f122ef247ebc1fdbd2240c831cb169a12b8015a32c",
    ),
    (
        b'{"id":"pin-2","work":{"kind":"process","argv":["sh","-c","echo hi"],'
        b'"env":{"Z":"1","A":"2"},"cwd":"/tmp"},"requirement":"gpu","resources":'
        b'{"cpu_millis":500,"memory_bytes":1048576,"gpus":1,"vram_bytes":1024},'
        b'"isolation":"dedicated","timeout_s":12.5}',
        "f6123f0a653c8cbdb01ad625901be9a5ccefe4579347fabe5b5116e1892e300f",
    ),
]


@pytest.mark.parametrize(("body", "digest"), PINNED)
def test_the_digest_of_a_request_without_labels_is_what_it_was(body: bytes, digest: str) -> None:
    request = msgspec.json.decode(body, type=InvocationRequest)
    assert request_digest(request) == digest
    # Labels are part of what was asked: another set is another request.
    labelled = msgspec.structs.replace(request, labels={"team": "ml"})
    other = msgspec.structs.replace(request, labels={"team": "infra"})
    assert len({request_digest(request), request_digest(labelled), request_digest(other)}) == 3


def _process(argv: list[str], env: dict[str, str] | None = None) -> ProcessWork:
    return ProcessWork(argv=argv, env=env or {})


def test_a_builtin_shows_its_name_never_its_args() -> None:
    command = command_of(BuiltinWork(name="sleep", args={"seconds": 5, "secret": "s3cr3t"}))
    assert (command.kind, command.name, command.argv) == ("builtin", "sleep", [])
    assert b"s3cr3t" not in msgspec.json.encode(command)


def test_a_short_argv_is_shown_whole() -> None:
    command = command_of(_process(["python", "train.py", "--epochs", "3"]))
    assert command.kind == "process" and command.name is None
    assert command.argv == ["python", "train.py", "--epochs", "3"]
    assert (command.argc, command.argv_cut) == (4, False)


def test_an_argv_past_the_count_bound_is_cut_and_says_so() -> None:
    argv = [f"a{n}" for n in range(40)]
    command = command_of(_process(argv))
    assert command.argv == argv[:MAX_COMMAND_ARGS]
    assert (command.argc, command.argv_cut) == (40, True)


def test_an_argv_past_the_size_bound_is_cut_with_a_marker() -> None:
    argv = ["sh", "-c", "x" * 5000, "after"]
    command = command_of(_process(argv))
    assert command.argv[:2] == ["sh", "-c"]
    assert command.argv[2].endswith("…") and command.argv[2].startswith("xxx")
    assert len(command.argv) == 3 and sum(map(len, command.argv)) == MAX_COMMAND_CHARS
    assert (command.argc, command.argv_cut) == (4, True)
    # Exactly at the bound: whole, nothing cut.
    exact = ["y" * (MAX_COMMAND_CHARS - 1), "z"]
    assert command_of(_process(exact)).argv == exact
    assert command_of(_process(exact)).argv_cut is False


def _invocation(request: InvocationRequest) -> Invocation:
    return Invocation(request, trio.CancelScope())


def test_the_status_carries_command_resources_labels_and_never_env_values() -> None:
    request = InvocationRequest(
        id="inv-1",
        work=_process(["python", "-c", "print(1)"], {"API_TOKEN": "hunter2-value"}),
        resources=Resources(cpu_millis=1500, memory_bytes=2**30, gpus=0, vram_bytes=0),
        labels={"team": "ml", "run": "exp-7"},
    )
    status = _invocation(request).status()
    assert status.command is not None and status.command.argv == ["python", "-c", "print(1)"]
    assert status.resources == request.resources
    assert status.labels == {"team": "ml", "run": "exp-7"}
    encoded = msgspec.json.encode(status)
    assert b"hunter2-value" not in encoded and b"API_TOKEN" not in encoded
    assert status.duration_s is not None and status.duration_s >= 0  # queued since submission


def test_duration_runs_from_start_to_end_or_now() -> None:
    start, end = "2026-03-01T10:00:00.250Z", "2026-03-01T10:02:05.750Z"
    assert duration_between(start, end) == 125.5
    assert duration_between(start, None, now=1772359210.25) == 10.0  # 10 s after start
    assert duration_between(end, start) == 0.0  # a clock stepped back: never below 0
    assert duration_between(None, end) is None
    assert duration_between("not a time", end) is None
    inv = _invocation(InvocationRequest(id="inv-2", work=BuiltinWork(name="sleep")))
    inv.submitted_at, inv.started_at = "2026-03-01T09:59:00.000Z", start
    final = inv.status(state=S.succeeded, ended_at=end)
    assert (final.ended_at, final.duration_s) == (end, 125.5)
    # Never started (cancelled while queued): from its submission.
    inv.started_at = None
    assert inv.status(state=S.cancelled, ended_at=end).duration_s == 185.75


def _record(outcome: bytes) -> EndedRecord:
    return EndedRecord(invocation_id="old", request_digest="d", ended_at=0.0, outcome=outcome)


def test_a_status_journaled_before_these_fields_still_decodes() -> None:
    old = (
        b'{"id":"old","state":"succeeded","reason":null,"requirement":"cpu",'
        b'"isolation":"shared","lanes":[{"lane_id":"lane_0000000000000000","kind":"cpu",'
        b'"vram_bytes":0}],"exit_code":0,"submitted_at":"2026-03-01T09:59:00.000Z",'
        b'"started_at":"2026-03-01T10:00:00.000Z","ended_at":"2026-03-01T10:00:01.500Z",'
        b'"stdout_tail":"","stderr_tail":"","stdout_bytes":0,"stderr_bytes":0,'
        b'"logs_cut":null,"usage":null,"uid":null,"network":null}'
    )
    status = recorded_status(_record(old))
    assert status.state is S.succeeded and status.reason is None
    assert (status.command, status.resources, status.labels) == (None, None, {})
    assert status.duration_s == 1.5
    assert status.lanes[0].kind == "cpu"
    # One a restart cut off never started: no duration is made up for it.
    restarted = old.replace(b'"started_at":"2026-03-01T10:00:00.000Z"', b'"started_at":null')
    assert recorded_status(_record(restarted)).duration_s is None


def test_a_new_status_round_trips_through_the_journal_encoding() -> None:
    request = InvocationRequest(id="inv-3", work=_process(["sleep", "1"]), labels={"team": "ml"})
    final = _invocation(request).status(state=S.succeeded, ended_at="2099-01-01T00:00:00.000Z")
    decoded = recorded_status(_record(msgspec.json.encode(final)))
    assert decoded == final


def _status(invocation_id: str, labels: dict[str, str]) -> InvocationStatus:
    request = InvocationRequest(id=invocation_id, work=BuiltinWork(name="sleep"), labels=labels)
    return _invocation(request).status()


def test_the_list_keeps_only_invocations_holding_every_label_asked_for() -> None:
    table: dict[str, dict[str, str]] = {
        "a": {"team": "ml", "run": "1"},
        "b": {"team": "ml", "run": "2"},
        "c": {"team": "infra"},
        "d": {},
    }
    items = [
        Listed(
            (f"2026-03-01T10:00:0{n}.000Z", iid),
            S.queued,
            functools.partial(_status, iid, labels),
            labels,
        )
        for n, (iid, labels) in enumerate(table.items())
    ]

    def ids(labels: tuple[tuple[str, str], ...]) -> list[str]:
        return [s.id for s in page(items, ListQuery(labels=labels)).invocations]

    assert ids(()) == ["d", "c", "b", "a"]
    assert ids((("team", "ml"),)) == ["b", "a"]
    assert ids((("run", "2"), ("team", "ml"))) == ["b"]
    assert ids((("team", "ml"), ("team", "infra"))) == []
    assert ids((("team", ""),)) == []


@pytest.mark.parametrize(
    ("labels", "field"),
    [
        ({"team\n": "ml"}, "labels"),  # the wire pattern's `$` matches before a newline
        ({"team": "ml\x1b[2J"}, "labels.team"),
        ({"team": "a\nb"}, "labels.team"),
    ],
)
def test_labels_the_wire_lets_through_are_still_refused(labels: dict[str, str], field: str) -> None:
    request = InvocationRequest(id="inv-4", work=BuiltinWork(name="sleep"), labels=labels)
    with pytest.raises(AdmissionRefused) as refused:
        check_request(request)
    assert (refused.value.status, refused.value.reason) == (422, "invalid_request")
    assert refused.value.details == {"field": field}


@pytest.mark.parametrize(
    "labels",
    [
        {"Team": "ml"},
        {"-team": "ml"},
        {"k" * 64: "v"},
        {"team": "v" * 257},
        {f"k{n}": "v" for n in range(17)},
    ],
)
def test_labels_out_of_the_wire_bounds_do_not_decode(labels: dict[str, str]) -> None:
    body = msgspec.json.encode(
        {"id": "x", "work": {"kind": "builtin", "name": "sleep"}, "labels": labels}
    )
    with pytest.raises(msgspec.ValidationError, match=r"\$\.labels"):
        msgspec.json.decode(body, type=InvocationRequest)
