"""Registered in-process functions an invocation can run by name (`builtin` work).

Each takes its JSON args and returns an exit code; a bad argument raises
`BuiltinArgumentError` before anything runs. They serve tests and the
workstation demo; production work runs as processes or lane work.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from supervisor.output import OutputRing

__all__ = ["BUILTINS", "BuiltinArgumentError", "BuiltinFailed", "check_builtin"]

MAX_SLEEP_S = 24 * 3600.0
MAX_ECHO_CHARS = 64 * 1024


class BuiltinArgumentError(ValueError):
    """The builtin's args are wrong; the submission is refused (caller's fault)."""


class BuiltinFailed(Exception):
    """The `fail` builtin's deliberate failure."""


Builtin = Callable[[Mapping[str, Any], OutputRing], Awaitable[int]]


def _seconds(args: Mapping[str, Any]) -> float:
    seconds = args.get("seconds", 0)
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        raise BuiltinArgumentError("sleep: seconds must be a number")
    if not 0 <= seconds <= MAX_SLEEP_S:
        raise BuiltinArgumentError(f"sleep: seconds must be in [0, {MAX_SLEEP_S:.0f}]")
    return float(seconds)


def _text(args: Mapping[str, Any]) -> str:
    text = args.get("text", "")
    if not isinstance(text, str) or len(text) > MAX_ECHO_CHARS:
        raise BuiltinArgumentError(f"echo: text must be a string of at most {MAX_ECHO_CHARS}")
    return text


def _message(args: Mapping[str, Any]) -> str:
    message = args.get("message", "failed on purpose")
    if not isinstance(message, str) or len(message) > 1024:
        raise BuiltinArgumentError("fail: message must be a short string")
    return message


async def _sleep(args: Mapping[str, Any], out: OutputRing) -> int:
    await trio.sleep(_seconds(args))
    return 0


async def _echo(args: Mapping[str, Any], out: OutputRing) -> int:
    out.write(_text(args).encode())
    await trio.lowlevel.checkpoint()
    return 0


async def _fail(args: Mapping[str, Any], out: OutputRing) -> int:
    await trio.lowlevel.checkpoint()
    raise BuiltinFailed(_message(args))


BUILTINS: dict[str, Builtin] = {"sleep": _sleep, "echo": _echo, "fail": _fail}
_CHECKS: dict[str, Callable[[Mapping[str, Any]], object]] = {
    "sleep": _seconds,
    "echo": _text,
    "fail": _message,
}


def check_builtin(name: str, args: Mapping[str, Any]) -> None:
    """Refuse an unknown builtin or bad args before anything is allocated."""
    if name not in BUILTINS:
        raise BuiltinArgumentError(f"unknown builtin {name!r} (known: {', '.join(BUILTINS)})")
    _CHECKS[name](args)
