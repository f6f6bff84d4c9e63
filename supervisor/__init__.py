"""Trio supervision of invocations and lane owners."""

__all__: list[str] = []
