"""The deployment files: the systemd unit is hardened ("OK" or better) yet leaves
confinement what it needs, and the DaemonSet is valid and does not cap guests."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

from node.machine.cgroups.v1 import BASE_DEVICES

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "litegraph-node.service"
CAPABILITIES = {"CAP_CHOWN", "CAP_SETUID", "CAP_SETGID", "CAP_KILL"}
# What bubblewrap calls as a guest uid (strace of a sandbox with every option the
# node uses), and what the daemon's child calls before exec.
BWRAP_SYSCALLS = {
    "capset",
    "clone",
    "mount",
    "pivot_root",
    "prctl",
    "sethostname",
    "socket",
    "umount2",
    "unshare",
}
CHILD_SYSCALLS = {"setgroups", "setresgid", "setresuid", "sched_setaffinity", "setrlimit", "kill"}
# Each v1 per-guest devices rule must be within one of the unit's DeviceAllow= entries.
DEVICE_PATHS = {
    "c 1:3 rwm": "/dev/null",
    "c 1:5 rwm": "/dev/zero",
    "c 1:7 rwm": "/dev/full",
    "c 1:8 rwm": "/dev/random",
    "c 1:9 rwm": "/dev/urandom",
    "c 5:0 rwm": "/dev/tty",
    "c 5:2 rwm": "/dev/ptmx",
    "c 136:* rwm": "char-pts",
}
# Each would break bubblewrap or ordinary guest programs (the unit says why).
MUST_STAY_OFF = (
    "ProtectKernelTunables",
    "ProtectKernelLogs",
    "ProtectHostname",
    "ProtectProc",
    "ProcSubset",
    "ProtectControlGroups",
    "MemoryDenyWriteExecute",
    "PrivateUsers",
    "PrivateDevices",
    "PrivateNetwork",
    "DynamicUser",
)


def unit_settings() -> dict[str, list[str]]:
    """Every `Key=value` of the unit, in order, repeated keys kept."""
    found: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if line.strip() and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    return tool


def expand_syscalls(tool: str, group: str) -> set[str]:
    """A system call group's members, nested groups expanded."""
    if not group.startswith("@"):
        return {group}
    out = subprocess.run(
        [tool, "syscall-filter", group], capture_output=True, text=True, check=True
    ).stdout
    names: set[str] = set()
    for line in out.splitlines()[1:]:
        name = line.strip()
        if name and not name.startswith("#"):
            names |= expand_syscalls(tool, name)
    return names


def test_the_unit_rates_ok_or_better_in_systemd_analyze_security() -> None:
    tool = systemd_analyze()
    result = subprocess.run(
        [tool, "security", "--offline=true", "--threshold=40", str(UNIT)],
        capture_output=True,
        text=True,
        check=False,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d)", result.stdout)
    assert match is not None, result.stdout + result.stderr
    assert float(match.group(1)) <= 4.0, result.stdout
    assert result.returncode == 0, result.stderr


def test_the_unit_verifies_without_a_warning(tmp_path: pathlib.Path) -> None:
    tool = systemd_analyze()
    # verify needs ExecStart= to exist: the installed venv is replaced by `true`.
    unit = tmp_path / UNIT.name
    unit.write_text(
        re.sub(r"(?m)^ExecStart=\S+", f"ExecStart={shutil.which('true')}", UNIT.read_text())
    )
    result = subprocess.run(
        [tool, "verify", "--man=no", str(unit)], capture_output=True, text=True, check=False
    )
    assert (result.returncode, result.stderr) == (0, ""), result.stderr


def test_the_system_call_filter_lets_bubblewrap_and_the_guest_child_run() -> None:
    tool = systemd_analyze()
    allowed: set[str] = set()
    denied: set[str] = set()
    for value in unit_settings()["SystemCallFilter"]:
        into = denied if value.startswith("~") else allowed
        for group in value.lstrip("~").split():
            into |= expand_syscalls(tool, group)
    missing = (BWRAP_SYSCALLS | CHILD_SYSCALLS) - (allowed - denied)
    assert not missing, f"the unit's filter refuses {sorted(missing)}"


def test_the_unit_grants_exactly_what_confinement_needs() -> None:
    settings = unit_settings()
    assert settings["User"] == ["litegraph"] and settings["Group"] == ["litegraph"]
    for key in ("CapabilityBoundingSet", "AmbientCapabilities"):
        assert [set(v.split()) for v in settings[key]] == [CAPABILITIES], key
    assert settings["Delegate"] == ["yes"]
    assert settings["RuntimeDirectory"] == ["litegraph-node"]
    assert settings["RuntimeDirectoryMode"] == ["0711"]
    assert settings["StateDirectoryMode"] == ["0700"]
    assert settings["NoNewPrivileges"] == ["yes"]
    for key in MUST_STAY_OFF:
        assert settings.get(key, ["no"]) == ["no"], f"{key} breaks guests"
    namespaces = set(" ".join(settings["RestrictNamespaces"]).split())
    assert {"user", "mnt", "pid", "ipc", "uts", "net", "cgroup"} <= namespaces
    assert "AF_NETLINK" in settings["RestrictAddressFamilies"][0].split()
    allowed = {tuple(v.split()) for v in settings["DeviceAllow"]}
    assert set(DEVICE_PATHS) == set(BASE_DEVICES)
    for path in DEVICE_PATHS.values():
        assert (path, "rwm") in allowed, path
    assert ("char-nvidia*", "rwm") in allowed
    assert settings["DevicePolicy"] == ["closed"]


def test_the_units_program_is_what_the_install_steps_create() -> None:
    exec_start = unit_settings()["ExecStart"][0].split()
    program = pathlib.PurePosixPath(exec_start[0])
    assert exec_start[1:] == ["serve"]
    assert program.name == "litegraph-node" and program.parent.name == "bin"
    steps = (DEPLOY / "README.md").read_text()
    assert f"python3 -m venv {program.parent.parent}\n" in steps
    assert f"{program.parent}/pip install " in steps


def test_the_daemonset_is_valid_yaml_and_leaves_guests_uncapped() -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    spec = yaml.safe_load((DEPLOY / "daemonset.yaml").read_text())["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    # Guests' cgroups live below the container's: a limit there caps them all.
    assert "limits" not in container["resources"], container["resources"]
    assert container["resources"]["requests"]["memory"]
    assert spec["hostPID"] is False
    assert spec["runtimeClassName"] == "nvidia"
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["seccompProfile"] == {"type": "Unconfined"}
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    run_dir = env["LITEGRAPH_NODE_GUEST_RUN_DIR"]
    assert "emptyDir" in volumes[mounts[run_dir]]
    # kubelet makes hostPath folders 0755; the daemon refuses that for its state
    # and makes a missing folder 0700 itself, so the state dir is below the mount.
    state = pathlib.PurePosixPath(env["LITEGRAPH_NODE_STATE_DIR"])
    assert state.parent.as_posix() in mounts and state.as_posix() not in mounts
    assert "hostPath" in volumes[mounts[state.parent.as_posix()]]
