"""Pages of the invocation list: filtered by state and labels, newest first, resumed
by a cursor.

Every listed invocation sorts by its key (submitted_at, id), newest first. Both
parts are fixed when it is admitted and an id is listed once, so a page that
starts strictly after the last key of the page before never repeats nor skips
an invocation that was listed all along, however many are submitted or end
meanwhile (a new one sorts before the first page: it was submitted later).
The cursor is that last key as base64url JSON: opaque to clients, and checked
on the way in like any other input.
"""

from __future__ import annotations

import base64
import binascii
import heapq
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Annotated, NamedTuple

import msgspec

from supervisor.wire import INVOCATION_ID_PATTERN, InvocationList, InvocationState, InvocationStatus

__all__ = [
    "CURSOR_PATTERN",
    "DEFAULT_LIST_LIMIT",
    "MAX_LABEL_FILTERS",
    "MAX_LIST_LIMIT",
    "InvalidCursor",
    "ListQuery",
    "Listed",
    "decode_cursor",
    "encode_cursor",
    "page",
]

# A page holds at most this many invocations (each carries up to 8 KiB of output tail).
MAX_LIST_LIMIT = 500
DEFAULT_LIST_LIMIT = 100
# What a cursor this module wrote looks like (the bound keeps a forged one cheap to refuse).
CURSOR_PATTERN = r"^[A-Za-z0-9_-]{1,512}$"
# Label filters in one query (an invocation holds at most MAX_LABELS labels anyway).
MAX_LABEL_FILTERS = 16
_NO_LABELS: Mapping[str, str] = MappingProxyType({})

Key = tuple[str, str]  # (submitted_at, id)


class _Cursor(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    version: Annotated[int, msgspec.Meta(ge=1, le=1)]
    # Any recorded time sorts (an older version's format too): only its size is bounded.
    submitted_at: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    id: Annotated[str, msgspec.Meta(pattern=INVOCATION_ID_PATTERN)]


class InvalidCursor(ValueError):
    """Not a cursor this node wrote."""


def encode_cursor(key: Key) -> str:
    raw = msgspec.json.encode(_Cursor(1, key[0], key[1]))
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def decode_cursor(text: str) -> Key:
    if not text or len(text) > 512:
        raise InvalidCursor("a cursor is 1 to 512 characters")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        cursor = msgspec.json.decode(raw, type=_Cursor)
    except (binascii.Error, ValueError, msgspec.DecodeError):
        raise InvalidCursor("not a cursor this node wrote") from None
    return cursor.submitted_at, cursor.id


class ListQuery(msgspec.Struct, frozen=True, kw_only=True):
    states: frozenset[InvocationState] | None = None  # None: every state
    # (key, value) pairs an invocation's labels must all hold; (): any labels.
    labels: tuple[tuple[str, str], ...] = ()
    limit: int = DEFAULT_LIST_LIMIT
    after: Key | None = None  # the last key of the previous page


class Listed(NamedTuple):
    """One candidate: its key, state and labels, and its status, built only if it is on
    the page."""

    key: Key
    state: InvocationState
    status: Callable[[], InvocationStatus]
    labels: Mapping[str, str] = _NO_LABELS


def _labelled(labels: Mapping[str, str], wanted: tuple[tuple[str, str], ...]) -> bool:
    return all(labels.get(key) == value for key, value in wanted)


def page(items: Iterable[Listed], query: ListQuery) -> InvocationList:
    """The page `query` asks for, and a cursor when more match after it."""
    after = query.after
    # One more than the page: whether another page follows, in O(n log limit).
    chosen = heapq.nlargest(
        query.limit + 1,
        (
            item
            for item in items
            if (query.states is None or item.state in query.states)
            and (after is None or item.key < after)
            and (not query.labels or _labelled(item.labels, query.labels))
        ),
        key=lambda item: item.key,
    )
    shown = chosen[: query.limit]
    more = len(chosen) > query.limit
    return InvocationList(
        invocations=[item.status() for item in shown],
        next_cursor=encode_cursor(shown[-1].key) if more else None,
    )
