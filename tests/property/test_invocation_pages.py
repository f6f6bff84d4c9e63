"""Property: paging the invocation list never repeats nor skips an invocation.

Between any two pages, invocations are submitted (with any submission time: the
wall clock may step back), others end or are forgotten, states change. Every
invocation listed from the first page to the last, in a state the filter
keeps, is seen exactly once; nothing is seen twice (an id forgotten and run
again is another invocation, with another key); each page is newest first.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from machine.lanes import Isolation, Requirement
from supervisor.listing import Listed, ListQuery, decode_cursor, page
from supervisor.wire import InvocationState, InvocationStatus

S = InvocationState
STATES = [S.queued, S.running, S.succeeded, S.failed]
stamps = st.integers(0, 5).map(lambda s: f"2026-12-01T05:00:0{s}.000Z")
ids = st.text("abcdef", min_size=1, max_size=3)
items = st.dictionaries(ids, st.tuples(stamps, st.sampled_from(STATES)), max_size=30)
changes = st.lists(
    st.tuples(st.sampled_from(["add", "forget", "restate"]), ids, stamps, st.sampled_from(STATES)),
    max_size=6,
)


def _status(invocation_id: str, at: str, state: InvocationState) -> InvocationStatus:
    return InvocationStatus(
        id=invocation_id,
        state=state,
        requirement=Requirement.CPU,
        isolation=Isolation.SHARED,
        lanes=[],
        submitted_at=at,
    )


def _listed(table: dict[str, tuple[str, InvocationState]]) -> list[Listed]:
    return [
        Listed((at, iid), state, lambda iid=iid, at=at, state=state: _status(iid, at, state))
        for iid, (at, state) in table.items()
    ]


@settings(max_examples=300, deadline=None)
@given(
    table=items,
    limit=st.integers(1, 7),
    wanted=st.none() | st.frozensets(st.sampled_from(STATES), min_size=1),
    between=st.lists(changes, max_size=12),
)
def test_pages_neither_repeat_nor_skip(
    table: dict[str, tuple[str, InvocationState]],
    limit: int,
    wanted: frozenset[InvocationState] | None,
    between: list[list[tuple[str, str, str, InvocationState]]],
) -> None:
    table = dict(table)
    steady = set(table)  # listed throughout, in a state the filter keeps throughout
    seen: list[tuple[str, str]] = []
    query = ListQuery(states=wanted, limit=limit)
    for round_ in range(100):
        listed = page(_listed(table), query)
        assert len(listed.invocations) <= limit
        keys = [(s.submitted_at, s.id) for s in listed.invocations]
        assert keys == sorted(keys, reverse=True)
        seen += keys
        for action, iid, at, state in between[round_] if round_ < len(between) else ():
            if action == "add" and iid not in table:
                table[iid] = (at, state)
            elif action == "forget":
                table.pop(iid, None)
                steady.discard(iid)
            elif action == "restate" and iid in table:
                table[iid] = (table[iid][0], state)
                steady.discard(iid)
        if listed.next_cursor is None:
            break
        assert decode_cursor(listed.next_cursor) == keys[-1]
        query = ListQuery(states=wanted, limit=limit, after=keys[-1])
    else:
        raise AssertionError("paging did not end")
    assert len(seen) == len(set(seen))
    kept = {(table[iid][0], iid) for iid in steady if wanted is None or table[iid][1] in wanted}
    assert kept <= set(seen)
