"""A kept thread (the journal's writer, guests' forks and cgroups): jobs run off the
event loop, one at a time, in the order asked; a caller that gives up is answered at
once, and a job it gave up on runs only if it had already started; a shielded job
always runs and its caller always gets what it made."""

from __future__ import annotations

import errno
import threading

import pytest
import trio
import trio.testing

from machine.kept_thread import KeptThread

WAIT = 5.0  # real-time bound for a thread to reach a gate


async def _wait(event: threading.Event) -> None:
    assert await trio.to_thread.run_sync(event.wait, WAIT)


async def test_writes_run_in_one_kept_thread_in_the_order_asked() -> None:
    writer = KeptThread("journal writer")
    ran: list[tuple[int, int]] = []

    def write(n: int) -> int:
        ran.append((n, threading.get_ident()))
        return n * 10

    results: dict[int, int] = {}

    async def one(n: int) -> None:
        results[n] = await writer.run(lambda: write(n))

    async with trio.open_nursery() as nursery:
        for n in range(20):
            nursery.start_soon(one, n)
            await trio.testing.wait_all_tasks_blocked()  # asked in this order
    assert results == {n: n * 10 for n in range(20)}
    assert [n for n, _ in ran] == list(range(20))
    threads = {ident for _, ident in ran}
    assert len(threads) == 1 and threading.get_ident() not in threads  # off the event loop
    assert writer.threads_started == 1


async def test_a_failed_write_raises_its_own_error_in_its_caller_only() -> None:
    writer = KeptThread("journal writer")

    def full_disk() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as raised:
        await writer.run(full_disk)
    assert raised.value.errno == errno.ENOSPC
    assert await writer.run(lambda: "next") == "next"  # the writer goes on


async def test_a_caller_that_gives_up_before_its_write_started_never_has_it_run() -> None:
    writer = KeptThread("journal writer")
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []

    def hung() -> None:
        started.set()
        gate.wait(WAIT)
        ran.append("hung")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.run, hung)
        await _wait(started)
        with trio.move_on_after(0.05) as scope:
            await writer.run(lambda: ran.append("gave-up"))
        assert scope.cancelled_caught
        assert writer.queued == 0  # taken out of the queue: nothing waits for it
        gate.set()
    await writer.run(lambda: ran.append("after"))
    assert ran == ["hung", "after"]


async def test_a_caller_that_gives_up_mid_write_returns_at_once_and_the_next_write_waits() -> None:
    writer = KeptThread("journal writer")
    gate, started = threading.Event(), threading.Event()
    events: list[str] = []

    def hung() -> None:
        started.set()
        gate.wait(WAIT)
        events.append("hung ended")

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.run, hung)
            await _wait(started)
            scope.cancel()  # a hung disk: the caller's deadline passes mid-write
    assert events == []  # its caller was answered while the write still runs

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.run, lambda: events.append("next"))
        await trio.sleep(0.05)
        assert events == []  # one write at a time: the next waits for the hung one
        gate.set()
    assert events == ["hung ended", "next"]


async def test_the_thread_ends_when_idle_and_the_next_write_starts_it_again() -> None:
    writer = KeptThread("idle-writer-test", idle_exit=0.02)

    first = await writer.run(threading.get_ident)
    (thread,) = [t for t in threading.enumerate() if t.name == "idle-writer-test"]
    await trio.to_thread.run_sync(thread.join, WAIT)
    assert not thread.is_alive()
    second = await writer.run(threading.get_ident)
    assert writer.threads_started == 2 and first != threading.get_ident() != second


async def test_a_shielded_job_runs_and_hands_back_what_it_made_to_a_cancelled_caller() -> None:
    thread = KeptThread("shield-test", idle_exit=None)
    gate, started = threading.Event(), threading.Event()
    made: list[str] = []

    def hold() -> None:
        started.set()
        gate.wait(WAIT)

    def fork() -> str:
        made.append("child")
        return "child"

    got: list[str] = []

    async def caller() -> None:
        got.append(await thread.run(fork, shield=True))
        await trio.lowlevel.checkpoint()  # the cancel lands here, after the result
        got.append("not reached")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(thread.run, hold)
        await _wait(started)
        nursery.start_soon(caller)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()  # while its job waits behind another, not started
        gate.set()
    assert made == ["child"] and got == ["child"]


def test_a_write_that_ends_after_its_run_is_gone_does_not_stop_the_writer() -> None:
    writer = KeptThread("journal writer")
    gate, started, finished = threading.Event(), threading.Event(), threading.Event()

    def hung() -> None:
        started.set()
        gate.wait(WAIT)
        finished.set()

    async def give_up() -> None:
        with trio.move_on_after(0.05):
            await writer.run(hung)

    trio.run(give_up)  # the run ends while its write still runs
    assert started.is_set()
    gate.set()
    assert finished.wait(WAIT)

    async def again() -> str:
        return await writer.run(lambda: "served")

    assert trio.run(again) == "served"  # another run is served by the same writer
