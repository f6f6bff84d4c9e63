"""Confinement is tested against the real kernel: root, bubblewrap, user namespaces."""

from __future__ import annotations

import os
import shutil

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = None
    if os.geteuid() != 0:
        reason = "needs root: guests run under uids of their own"
    elif shutil.which("bwrap") is None:
        reason = "needs bubblewrap (make test installs it: apt-get install bubblewrap)"
    if reason is None:
        return
    for item in items:
        if "tests/confinement" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=reason))
