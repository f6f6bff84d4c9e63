"""Properties of the owner-to-host framing of lane work, over arbitrary values.

Whatever a caller sends - any JSON value for an execute's args, integers of any
size, nan and infinities, strings, lists and objects nested in each other, or
the same built straight in Python past the edge's decoder - exactly one of these
holds, and nothing else is ever raised:

- the daemon refuses it with a typed error before anything is framed: the edge's
  decoder (400 malformed JSON, 422 `invalid_request`), or the lane owner's check,
  `LaneWorkError(422, "bad_args")`;
- or the owner's frame encodes, within the frame bound, and the host's own decoder
  (`lanehost.protocol.decode_request`) reads back the very request it was built
  from, which re-encodes to the same bytes; the host answers it with the request's
  own id, so the conversation stays in step.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import msgspec
from hypothesis import event, example, given
from hypothesis import strategies as st

from lanehost.backend import select_backend
from lanehost.host import _answer
from lanehost.kernels import Kernel, load_kernels
from lanehost.protocol import (
    DTYPES,
    HEADER,
    MAX_ARGS,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Alloc,
    ErrorReply,
    Hello,
    Read,
    Request,
    Run,
    Write,
    decode_request,
)
from lanehost.state import LaneState
from supervisor.lane_checks import check_job
from supervisor.lane_host import request_frames
from supervisor.lane_work import (
    Download,
    Execute,
    LaneJob,
    LaneWorkError,
    LaneWorkRequest,
    MemoryRelease,
    MemoryReserve,
    Upload,
)

BUF = "buf_" + "a" * 32
EDGES = [2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 2**70, -(2**70)]

# Integers of any size, the 64-bit edges around them more often than chance would.
integers = st.integers() | st.sampled_from(EDGES) | st.integers(-(2**80), 2**80)
floats = st.floats()  # nan and both infinities included
numbers = st.booleans() | integers | floats
scalars = st.none() | numbers | st.text(max_size=40)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)
arg_names = st.from_regex(r"[a-z][a-z0-9_]{0,31}", fullmatch=True)
names = arg_names | arg_names | st.text(max_size=40)
# An execute's args: objects of numbers under well-formed names (the values the
# wire may or may not carry), objects of any JSON values, and any JSON value at all.
any_args = (
    st.dictionaries(arg_names, numbers, max_size=MAX_ARGS + 1)
    | st.dictionaries(arg_names, numbers, max_size=3)
    | st.dictionaries(names, json_values, max_size=MAX_ARGS + 1)
    | json_values
)
kernels = st.sampled_from(["noop", "fill", "sum"]) | st.just("noop") | st.text(max_size=70)
buffer_maps = st.just({}) | st.dictionaries(names, st.just(BUF) | st.text(max_size=70), max_size=4)
dims = st.integers(-1, 2**40 + 1) | st.integers(1, 64) | integers
offsets = st.integers(-1, 2**62 + 1) | st.integers(0, 64) | integers
lengths = st.integers(-1, 2**26 + 1) | st.integers(0, 64) | integers


@functools.cache
def _kernels() -> dict[str, Kernel]:
    return load_kernels()


def host_request(work: LaneJob) -> Request:
    """What the owner asks its host for this work (`LaneJobRunner`, `LaneHost`):
    the request the host's decoder must give back."""
    if isinstance(work, Execute):
        return Run(id=7, kernel=work.kernel, args=dict(work.args), buffers=dict(work.buffers))
    if isinstance(work, MemoryReserve):
        return Alloc(id=7, buffer_id=BUF, dtype=work.dtype, shape=tuple(work.shape))
    if isinstance(work, Upload):
        return Write(id=7, buffer_id=work.buffer_id, offset=work.offset, data=memoryview(work.data))
    if isinstance(work, Download):
        return Read(id=7, buffer_id=work.buffer_id, offset=work.offset, length=work.length)
    raise AssertionError(f"no host request for {work!r}")


def owner_frames(work: LaneJob) -> bytes | None:
    """The frame the owner sends, or None when the owner refused the work, typed."""
    try:
        check_job(work)
    except LaneWorkError as refused:
        assert (refused.status, refused.code) == (422, "bad_args")
        return None
    # Checked: it must frame. A LaneHostError here would be a check that let it by.
    return b"".join(bytes(part) for part in request_frames(host_request(work)))


def assert_decodes_back(work: LaneJob, sent: bytes) -> None:
    request = host_request(work)
    (length,) = HEADER.unpack(sent[: HEADER.size])
    payload = sent[HEADER.size :]
    assert length == len(payload) <= MAX_FRAME_BYTES
    decoded = decode_request(payload)
    assert decoded == request
    assert msgspec.msgpack.encode(decoded) == payload  # bool stays bool, int stays int
    # The host itself answers it as that request, never as an unreadable frame.
    state = LaneState(select_backend("numpy"), 1 << 16, _kernels())
    state.handle(Hello(id=1, version=PROTOCOL_VERSION))
    reply = _answer(state, bytearray(payload))
    assert reply.id == request.id
    assert not (isinstance(reply, ErrorReply) and reply.code == "bad_request")


def refused_or_round_trips(work: LaneJob) -> None:
    sent = owner_frames(work)
    event("refused by the owner" if sent is None else "framed and read back")
    if sent is not None:
        assert_decodes_back(work, sent)


@given(args=any_args, kernel=kernels, buffers=buffer_maps)
@example(args={"x": 1180591620717411303424}, kernel="noop", buffers={})
@example(args={"x": float("nan")}, kernel="noop", buffers={})
def test_a_json_body_is_refused_typed_or_framed_and_read_back_unchanged(
    args: Any, kernel: Any, buffers: Any
) -> None:
    body = json.dumps({"op": "execute", "kernel": kernel, "args": args, "buffers": buffers})
    try:  # as the edge decodes a body (api.http.decode_body)
        work = msgspec.json.decode(body.encode(), type=LaneWorkRequest)
    except msgspec.ValidationError:  # a DecodeError too: first
        event("422 invalid_request at the edge")
        return
    except msgspec.DecodeError:
        event("400 at the edge")
        return  # not JSON (NaN and Infinity are not)
    refused_or_round_trips(work)


@given(args=any_args, kernel=kernels | json_values, buffers=buffer_maps | json_values)
@example(args={"x": 2**63}, kernel="noop", buffers={})
@example(args={"x": float("inf")}, kernel="noop", buffers={})
def test_work_built_in_python_is_refused_typed_or_framed_and_read_back_unchanged(
    args: Any, kernel: Any, buffers: Any
) -> None:
    """Past the edge's decoder (msgspec does not check a Struct built in Python)."""
    refused_or_round_trips(Execute(kernel=kernel, args=args, buffers=buffers))


@given(
    dtype=st.sampled_from(DTYPES) | st.sampled_from(DTYPES) | json_values,
    shape=st.lists(st.integers(1, 2**40), min_size=1, max_size=8)
    | st.lists(dims, max_size=9)
    | st.lists(dims | json_values, max_size=10)
    | json_values,
)
def test_a_memory_reserve_is_refused_typed_or_framed_and_read_back_unchanged(
    dtype: Any, shape: Any
) -> None:
    refused_or_round_trips(MemoryReserve(dtype=dtype, shape=shape))


@given(
    buffer_id=st.just(BUF) | st.just(BUF) | st.text(max_size=70) | json_values,
    offset=offsets | offsets | json_values,
    length=lengths | lengths | json_values,
    data=st.binary(max_size=64),
)
def test_transfers_are_refused_typed_or_framed_and_read_back_unchanged(
    buffer_id: Any, offset: Any, length: Any, data: bytes
) -> None:
    refused_or_round_trips(Upload(buffer_id=buffer_id, offset=offset, data=data))
    refused_or_round_trips(Download(buffer_id=buffer_id, offset=offset, length=length))
    try:
        check_job(MemoryRelease(buffer_id=buffer_id))
    except LaneWorkError as refused:
        assert (refused.status, refused.code) == (422, "bad_args")
