"""Test-wide settings: hypothesis profiles and the checkout-first import path."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from tests.helpers import remove_guest_dirs
from tests.worker_cgroups import own_cgroups

# CI runs on 2 cores; the "ci" profile is still large enough to mean something
# (state machines ask for at least 200 examples on their own).
settings.register_profile(
    "ci", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="session")
def _remove_guest_folders() -> Iterator[None]:
    yield
    remove_guest_dirs()


@pytest.fixture(autouse=True, scope="session")
def _a_cgroup_per_worker() -> Iterator[None]:
    """pytest-xdist workers start daemons side by side: each worker gets cgroups of its
    own (as root), so their invocations' cgroups never share a parent."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None or os.geteuid() != 0:
        yield
        return
    with own_cgroups(f"lgtests-{worker}-{os.getpid()}"):
        yield


@pytest.fixture
def in_process_lane_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's lanes get in-process test hosts, whose `sleep` kernel holds a lane."""
    import node.daemon
    from tests.lane_doubles import InProcessHosts

    monkeypatch.setattr(node.daemon, "lane_host_factory", lambda *_a, **_k: InProcessHosts())
