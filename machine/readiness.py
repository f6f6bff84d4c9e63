"""What the daemon still waits for before it is ready (GET /readyz)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Readiness"]


class Readiness:
    """Start-up steps still pending plus standing reasons that block readiness.

    A step is pending until `done(step)`; a reason (for example a failed NVML
    initialisation) stays until `clear(key)`; a check (for example "can the
    journal write?") is asked on every read. Ready means none of them is left.
    """

    def __init__(self, steps: tuple[str, ...]) -> None:
        self._pending = dict.fromkeys(steps, "not done yet")
        self._reasons: dict[str, str] = {}
        self._notes: dict[str, str] = {}
        self._checks: dict[str, Callable[[], str | None]] = {}
        self._note_checks: dict[str, Callable[[], str | None]] = {}

    def done(self, step: str) -> None:
        self._pending.pop(step, None)

    def block(self, key: str, reason: str) -> None:
        self._reasons[key] = reason

    def clear(self, key: str) -> None:
        self._reasons.pop(key, None)

    def check(self, key: str, reason: Callable[[], str | None]) -> None:
        """Block while `reason()` returns a reason (it must be cheap: no I/O)."""
        self._checks[key] = reason

    def note(self, key: str, text: str) -> None:
        """Worth knowing, not blocking (no NVML on a CPU-only node in `auto` mode)."""
        self._notes[key] = text

    def check_note(self, key: str, note: Callable[[], str | None]) -> None:
        """A note while `note()` returns one (cheap, no I/O), asked on every read."""
        self._note_checks[key] = note

    def notes(self) -> dict[str, str]:
        live = {key: note() for key, note in self._note_checks.items()}
        return {**self._notes, **{key: text for key, text in live.items() if text is not None}}

    @property
    def ready(self) -> bool:
        return not self.reasons()

    def reasons(self) -> dict[str, str]:
        checked = {key: reason() for key, reason in self._checks.items()}
        live = {key: reason for key, reason in checked.items() if reason is not None}
        return {**self._pending, **self._reasons, **live}
