"""Every class gets a network namespace of its own (loopback only) and no node URL
that would lead nowhere; a guest that asked for the host's network, on a node that
allows it, keeps the host's, and its session says which it got."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from machine.lanes import Isolation, build_lanes
from supervisor.guests import GuestPolicy, guest_session
from supervisor.sandbox import SandboxSpec, bwrap_argv
from supervisor.wire import GuestNetwork
from tests.unit.supervisor.test_guests import _inventory

BWRAP = pathlib.Path("/usr/bin/bwrap")
URL = "http://127.0.0.1:8080"


def test_a_sandbox_has_its_own_network_unless_it_is_given_the_hosts() -> None:
    assert "--unshare-net" in bwrap_argv(SandboxSpec(bwrap=BWRAP), ["x"])
    assert "--unshare-net" not in bwrap_argv(SandboxSpec(bwrap=BWRAP, isolate_network=False), ["x"])


def _session(
    tmp_path: pathlib.Path, isolation: Isolation, network: GuestNetwork, bwrap: Any = BWRAP
) -> Any:
    inventory = _inventory()
    policy = GuestPolicy(
        bwrap=bwrap,
        uids=None,
        state_dir=tmp_path / "state",
        run_dir=tmp_path,
        node_socket=tmp_path / "node.sock",
        host_network=True,
    )
    return guest_session(
        policy,
        isolation=isolation,
        lanes=[build_lanes(inventory)[0]],
        tokens=["v4.public.x"],
        inventory=inventory,
        cwd=None,
        node_url=URL,
        network=network,
    )


@pytest.mark.parametrize("isolation", list(Isolation))
def test_every_class_gets_its_own_network_and_the_nodes_socket_not_its_url(
    tmp_path: pathlib.Path, isolation: Isolation
) -> None:
    """The report: `shared`, `dedicated` and `partitioned` guests had the host's network."""
    with _session(tmp_path, isolation, GuestNetwork.NONE) as guest:
        assert guest.network is GuestNetwork.NONE
        assert "--unshare-net" in bwrap_argv(guest.sandbox, ["x"])
        assert "LITEGRAPH_NODE_URL" not in guest.env  # a loopback that leads nowhere
        assert "LITEGRAPH_NODE_SOCKET" in guest.env


@pytest.mark.parametrize(
    "isolation", [Isolation.SHARED, Isolation.DEDICATED, Isolation.PARTITIONED]
)
def test_a_guest_given_the_host_network_keeps_it_and_the_nodes_url(
    tmp_path: pathlib.Path, isolation: Isolation
) -> None:
    with _session(tmp_path, isolation, GuestNetwork.HOST) as guest:
        assert guest.network is GuestNetwork.HOST
        assert "--unshare-net" not in bwrap_argv(guest.sandbox, ["x"])
        assert guest.env["LITEGRAPH_NODE_URL"] == URL


def test_a_sandbox_guest_never_has_the_host_network(tmp_path: pathlib.Path) -> None:
    with _session(tmp_path, Isolation.SANDBOX, GuestNetwork.HOST) as guest:
        assert guest.network is GuestNetwork.NONE
        assert "--unshare-net" in bwrap_argv(guest.sandbox, ["x"])
        assert "LITEGRAPH_NODE_URL" not in guest.env


def test_an_unconfined_guest_is_said_to_have_the_host_network(tmp_path: pathlib.Path) -> None:
    with _session(tmp_path, Isolation.SHARED, GuestNetwork.NONE, bwrap=None) as guest:
        assert guest.sandbox is None
        assert guest.network is GuestNetwork.HOST
        assert guest.env["LITEGRAPH_NODE_URL"] == URL
