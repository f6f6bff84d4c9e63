"""Markers of the adversarial suite (registered here only, as --strict-markers wants)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "hostile(category): a hostile-input case; category is the threat-model row"
    )
