"""`run`'s options as the InvocationRequest it submits; a bad value is a FlagError
naming the flag (exit 2), found before anything reaches the daemon."""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from machine.lanes import Isolation, Requirement
from node.config import parse_size
from node.flags import FlagError
from supervisor.process import InvalidProcessRequest, validate_env
from supervisor.wire import MAX_TIMEOUT_S, GuestNetwork, InvocationRequest, ProcessWork, Resources

__all__ = ["NO_CWD", "build_request", "parse_cpu"]

_CPU = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(m?)\s*$")
MAX_CPU_MILLIS = 2**31
MAX_GPUS = 64


def parse_cpu(text: str) -> int:
    """Cores as CPU millis: `2`, `0.5` or `250m` (millicores)."""
    match = _CPU.match(text)
    if match is None:
        raise ValueError("expected cores such as 2, 0.5 or 250m")
    number, milli = float(match.group(1)), bool(match.group(2))
    millis = math.ceil(number if milli else number * 1000)
    if not 1 <= millis <= MAX_CPU_MILLIS:
        raise ValueError(f"must be from 1m to {MAX_CPU_MILLIS}m")
    return millis


def _size(text: str) -> int:
    value = parse_size(text)
    if value > 2**53:
        raise ValueError("too large")
    return value


def _memory(text: str) -> int:
    value = _size(text)
    if value < 1:
        raise ValueError("must be above 0")  # 0 would mean no limit
    return value


def _gpus(count: int) -> int:
    if not 0 <= count <= MAX_GPUS:
        raise ValueError(f"must be from 0 to {MAX_GPUS}")
    return count


def _choice(kind: type[Isolation] | type[Requirement] | type[GuestNetwork]) -> Callable[[str], Any]:
    def check(text: str) -> Any:
        if not text and kind is Requirement:
            return None  # not given: decided by what the request asks for (`_requirement`)
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"expected one of {', '.join(k.value for k in kind)}") from None

    return check


def _env(pairs: list[Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        if not isinstance(pair, str) or "=" not in pair or pair.startswith("="):
            raise ValueError(f"expected KEY=VALUE, got {pair!r}")
        key, _, value = pair.partition("=")
        env[key] = value
    try:
        validate_env(env)
    except InvalidProcessRequest as exc:
        raise ValueError(str(exc).removeprefix("env.")) from None
    return env


NO_CWD = "none"


def _cwd(text: str) -> str | None:
    """None for `--cwd none` (no cwd is sent: the guest starts in its private /tmp)."""
    if text == NO_CWD:
        return None
    if text and (not text.startswith("/") or "\0" in text):
        raise ValueError(f"must be an absolute path, or {NO_CWD} to send no cwd")
    return text


def _timeout(seconds: float) -> float:
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise ValueError(f"must be in (0, {MAX_TIMEOUT_S:g}] seconds")
    return seconds


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "cpu": parse_cpu,
    "memory": _memory,
    "gpus": _gpus,
    "vram": _size,
    "isolation": _choice(Isolation),
    "network": _choice(GuestNetwork),
    "requirement": _choice(Requirement),
    "env": _env,
    "cwd": _cwd,
    "timeout": _timeout,
}


def _requirement(checked: Mapping[str, Any]) -> Requirement:
    """What `run` asks for when --requirement is not given: a GPU lane whenever it
    asks for a device (GPUs, VRAM or a MIG instance), so such a request gets one or
    a refusal, never a silent run on the CPU; otherwise `auto`."""
    given: Requirement | None = checked["requirement"]
    if given is not None:
        return given
    wants_device = (
        checked["gpus"] > 0 or checked["vram"] > 0 or checked["isolation"] is Isolation.PARTITIONED
    )
    return Requirement.GPU if wants_device else Requirement.AUTO


def build_request(options: Mapping[str, Any], argv: list[str], cwd: str) -> InvocationRequest:
    """The request for `run -- argv`; every bad option is named in one FlagError.
    Its cwd is `--cwd`, else the current folder `cwd`; none with `--cwd none`."""
    checked: dict[str, Any] = {}
    problems = []
    for name, check in _CHECKS.items():
        try:
            checked[name] = check(options[name])
        except ValueError as exc:
            # A list (--env) names its bad item itself.
            got = "" if isinstance(options[name], list) else f" (got {options[name]!r})"
            problems.append(f"--{name}: {exc}{got}")
    if problems:
        raise FlagError("; ".join(problems))
    return InvocationRequest(
        id="run-" + secrets.token_hex(8),
        work=ProcessWork(
            argv=argv,
            env=checked["env"],
            cwd=None if checked["cwd"] is None else checked["cwd"] or cwd,
            network=checked["network"],
        ),
        requirement=_requirement(checked),
        resources=Resources(
            cpu_millis=checked["cpu"],
            memory_bytes=checked["memory"],
            gpus=checked["gpus"],
            vram_bytes=checked["vram"],
        ),
        isolation=checked["isolation"],
        timeout_s=checked["timeout"],
    )
