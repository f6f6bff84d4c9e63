"""The pieces of guest confinement that need no kernel: uid ranges and pool, the
sandbox's command line, and which device nodes a lane needs."""

from __future__ import annotations

import os
import pathlib
import stat
from typing import Any

import pytest

from machine.devnodes import lane_device_nodes, read_mig_minors
from machine.inventory import CpuInfo, GpuDevice, Inventory, MemoryInfo, MigInstance
from machine.lanes import Isolation, build_lanes
from supervisor.guests import GuestPolicy, guest_session, remove_stale_tokens
from supervisor.identity import UidPool, UidRangeError, UidsExhausted, parse_uid_range
from supervisor.process import ProcessStuck
from supervisor.sandbox import NODE_SOCKET, TOKEN_FILE, SandboxSpec, bwrap_argv


@pytest.mark.parametrize(
    "text", ["", "5", "200000", "2-1", "0-10", "999-2000", "1000-4294967295", "a-b", "1000 - 2000"]
)
def test_a_bad_uid_range_is_refused(text: str) -> None:
    with pytest.raises(UidRangeError):
        parse_uid_range(text, daemon_uid=0)


def test_a_range_holding_the_daemons_own_uid_is_refused() -> None:
    with pytest.raises(UidRangeError, match="daemon's own uid"):
        parse_uid_range("1000-2000", daemon_uid=1500)
    assert parse_uid_range("200000-200009", daemon_uid=0) == range(200000, 200010)


def test_the_pool_hands_out_distinct_uids_and_reuses_a_released_one_last() -> None:
    pool = UidPool(range(10, 13))
    first, second, third = pool.allocate(), pool.allocate(), pool.allocate()
    assert {first, second, third} == {10, 11, 12}
    with pytest.raises(UidsExhausted):
        pool.allocate()
    pool.release(second)
    assert pool.allocate() == second
    pool.release(first)
    pool.release(third)
    assert pool.allocate() == third  # round-robin: the next in turn, not the latest freed


def _spec(tmp_path: pathlib.Path, **fields: object) -> SandboxSpec:
    bwrap = pathlib.Path("/usr/bin/bwrap")
    return SandboxSpec(bwrap=bwrap, isolate_network=False, **fields)  # type: ignore[arg-type]


def test_the_sandbox_unshares_namespaces_and_dies_with_its_parent(tmp_path: pathlib.Path) -> None:
    argv = bwrap_argv(_spec(tmp_path), ["true"])
    for flag in ("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent"):
        assert flag in argv
    assert "--unshare-net" not in argv
    assert argv[-2:] == ["--", "true"]
    sandboxed = bwrap_argv(SandboxSpec(bwrap=pathlib.Path("b"), isolate_network=True), ["x"])
    assert "--unshare-net" in sandboxed


def test_tokens_socket_and_devices_are_bound_where_the_guest_looks(tmp_path: pathlib.Path) -> None:
    sock = tmp_path / "node.sock"
    argv = bwrap_argv(
        _spec(
            tmp_path,
            token_fd=9,
            node_socket=sock,
            device_nodes=(tmp_path / "nvidia1", tmp_path / "nvidia-caps" / "nvidia-cap3"),
            dev_root=tmp_path,
        ),
        ["true"],
    )
    text = " ".join(argv)
    # Copied in from the descriptor: no host path on the command line.
    assert f"--perms 0400 --ro-bind-data 9 {TOKEN_FILE}" in text
    assert f"--bind {sock} {NODE_SOCKET}" in text
    assert f"--dev-bind {tmp_path}/nvidia1 /dev/nvidia1" in text
    assert f"--dev-bind {tmp_path}/nvidia-caps/nvidia-cap3 /dev/nvidia-caps/nvidia-cap3" in text
    assert text.index("--dev /dev") < text.index("--dev-bind")  # bound over the minimal /dev


def test_secrets_under_a_bound_folder_are_masked_and_missing_ones_never_made(
    tmp_path: pathlib.Path,
) -> None:
    state, auth, missing = tmp_path / "state", tmp_path / "auth.json", tmp_path / "gone"
    state.mkdir()
    auth.write_text("{}")
    spec = _spec(tmp_path, cwd=str(tmp_path), cwd_fd=7, masked=(state, auth, missing))
    text = " ".join(bwrap_argv(spec, ["x"]))
    assert f"--tmpfs {state}" in text
    assert f"--ro-bind /dev/null {auth}" in text
    assert str(missing) not in text
    # Masks come after the bind they cover: later mounts win.
    assert text.index(f"--ro-bind-fd 7 {tmp_path}") < text.index(f"--tmpfs {state}")
    outside = bwrap_argv(_spec(tmp_path, masked=(state,)), ["x"])
    assert str(state) not in " ".join(outside)  # nothing binds it: nothing to hide


def test_a_cwd_is_bound_from_its_descriptor_never_by_its_name(tmp_path: pathlib.Path) -> None:
    argv = bwrap_argv(_spec(tmp_path, cwd=str(tmp_path), cwd_fd=9), ["x"])
    at = argv.index("--ro-bind-fd")
    assert argv[at : at + 3] == ["--ro-bind-fd", "9", str(tmp_path)]
    assert argv[argv.index("--chdir") + 1] == str(tmp_path)
    with pytest.raises(ValueError, match="descriptor"):
        bwrap_argv(_spec(tmp_path, cwd=str(tmp_path)), ["x"])


def _inventory() -> Inventory:
    return Inventory(
        backend="sim",
        cpu=CpuInfo(
            logical_cores=2, physical_cores=2, model="x", numa_nodes=1, capacity_millis=2000
        ),
        memory=MemoryInfo(total_bytes=2**30, available_bytes=2**30, capacity_bytes=2**30),
        gpus=(
            GpuDevice(
                uuid="GPU-a", name="a", pci_bus_id=None, memory_total_bytes=2**30, minor_number=0
            ),
            GpuDevice(
                uuid="GPU-b",
                name="b",
                pci_bus_id=None,
                memory_total_bytes=2**30,
                minor_number=1,
                mig_enabled=True,
                mig_instances=(
                    MigInstance(
                        uuid="MIG-b1",
                        name="1g",
                        memory_total_bytes=2**29,
                        gpu_instance_id=2,
                        compute_instance_id=0,
                    ),
                ),
            ),
        ),
    )


def test_a_lane_needs_its_gpu_node_the_control_nodes_and_its_mig_caps(
    tmp_path: pathlib.Path,
) -> None:
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-caps/nvidia-cap21"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    inventory = _inventory()
    cpu, gpu, mig = build_lanes(inventory)
    assert lane_device_nodes(inventory, cpu, tmp_path) == ()
    assert {p.name for p in lane_device_nodes(inventory, gpu, tmp_path)} == {
        "nvidia0",
        "nvidiactl",
        "nvidia-uvm",  # nvidia-uvm-tools is absent here: only nodes that exist
    }
    minors = {"gpu1/gi2": 21, "gpu1/gi2/ci0": 22}
    found = lane_device_nodes(inventory, mig, tmp_path, minors)
    nodes = {str(p.relative_to(tmp_path)) for p in found}
    assert nodes == {"nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-caps/nvidia-cap21"}


def test_mig_minors_are_read_from_the_drivers_list(tmp_path: pathlib.Path) -> None:
    listing = tmp_path / "mig-minors"
    listing.write_text("config 1\nmonitor 2\ngpu0/gi1/access 3\ngpu0/gi1/ci0/access 4\nbad line\n")
    assert read_mig_minors(listing) == {"gpu0/gi1": 3, "gpu0/gi1/ci0": 4}
    assert read_mig_minors(tmp_path / "absent") == {}
    assert os.path.exists(listing)


# The token file is handed to the guest's uid: only root may do that.
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to another uid: root")


def session_with(policy: GuestPolicy, cwd: str | None = None, memory_bytes: int = 2**26) -> Any:
    """`guest_session` for one CPU guest under `policy`."""
    inventory = _inventory()
    return guest_session(
        policy,
        isolation=Isolation.SHARED,
        lanes=[build_lanes(inventory)[0]],
        tokens=["v4.public.x"],
        inventory=inventory,
        cwd=cwd,
        node_url="",
        memory_bytes=memory_bytes,
    )


def _session_of(pool: UidPool, tmp_path: pathlib.Path) -> Any:
    policy = GuestPolicy(bwrap=None, uids=pool, state_dir=tmp_path / "state", run_dir=tmp_path)
    return session_with(policy)


@needs_root
def test_a_guests_uid_returns_to_the_pool_when_it_ends(tmp_path: pathlib.Path) -> None:
    pool = UidPool(range(300_000, 300_002))
    with _session_of(pool, tmp_path) as guest:
        assert guest.uid in pool.in_use
    assert pool.in_use == frozenset()


@needs_root
def test_the_uid_of_a_process_that_survived_sigkill_is_never_reused(
    tmp_path: pathlib.Path,
) -> None:
    pool = UidPool(range(300_000, 300_002))
    with pytest.raises(ProcessStuck), _session_of(pool, tmp_path) as guest:
        raise ProcessStuck(12345)
    assert pool.in_use == frozenset({guest.uid})
    # Marked stuck by its run (on_stuck) while something else ended it (a cancel):
    # held all the same.
    with pytest.raises(KeyboardInterrupt), _session_of(pool, tmp_path) as cancelled:
        cancelled.stuck = True
        raise KeyboardInterrupt
    assert pool.in_use == frozenset({guest.uid, cancelled.uid})


@needs_root
def test_a_guests_token_file_is_its_own_0400_file_in_the_run_dir_and_goes_with_it(
    tmp_path: pathlib.Path,
) -> None:
    pool = UidPool(range(300_000, 300_002))
    with _session_of(pool, tmp_path) as guest:
        path = pathlib.Path(guest.env["LITEGRAPH_CAPABILITY_TOKEN_FILE"])
        # No folder of its own: one file straight in the daemon's run dir.
        assert list(tmp_path.iterdir()) == [path]
        found = path.lstat()
        assert stat.S_ISREG(found.st_mode) and stat.S_IMODE(found.st_mode) == 0o400
        assert found.st_uid == guest.uid
        assert path.read_text() == "v4.public.x\n"
    assert list(tmp_path.iterdir()) == []


def test_token_files_a_killed_daemon_left_in_the_run_dir_are_removed_and_nothing_else(
    tmp_path: pathlib.Path,
) -> None:
    left = [tmp_path / f"guest-{n:032x}.tokens" for n in (1, 2)]
    for path in left:
        path.write_text("v4.public.x\n")
    kept = [tmp_path / "node.sock", tmp_path / "guest-notes.tokens", tmp_path / "notes"]
    for path in kept:
        path.write_text("")
    (tmp_path / f"guest-{3:032x}.tokens").mkdir()
    assert remove_stale_tokens(tmp_path) == 2
    assert not any(path.exists() for path in left)
    assert all(path.exists() for path in kept)
