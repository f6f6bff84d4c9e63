"""Typed configuration: one Struct, built and validated in one place.

`build_config` takes the typed map from `node.flags.coerce` and returns a
`Config` or raises `FlagError` naming each bad flag. Every field here is a
flag in `.cli-flags.toml` and every flag there is a field here (a test pins it).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import urllib.parse
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, TypeVar

import msgspec

from node.flags import FlagError
from supervisor.identity import UidRangeError, parse_uid_range

__all__ = ["Config", "DeviceMode", "LogFormat", "LogLevel", "build_config", "parse_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9-]{1,63})*$")
MAX_TOKEN_TTL = 3600.0
_Num = TypeVar("_Num", int, float)


class DeviceMode(StrEnum):
    auto = "auto"
    nvml = "nvml"
    sim = "sim"
    none = "none"


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


class LogFormat(StrEnum):
    text = "text"
    json = "json"


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The daemon's options after validation; sizes in bytes, times in seconds."""

    listen: str
    node_id: str
    state_dir: str
    devices: DeviceMode
    sim_file: str
    reserved_cpu: int
    reserved_memory: int
    vram_headroom: int
    fatal_xids: tuple[int, ...]
    recovery_probes: int
    max_queued: int
    max_running: int
    token_ttl: float
    scheduler_url: str
    telemetry_interval: float
    telemetry_bearer_file: str
    health_interval: float
    shutdown_grace: float
    kill_grace: float
    sandbox_pool: int
    state_lock_wait: float
    accept_journal_loss: bool
    idempotency_window: float
    idempotency_max_ids: int
    http_read_timeout: float
    http_body_timeout: float
    http_keep_alive: float
    auth_file: str
    metrics_auth: bool
    sandbox_tool: str
    allow_unconfined_guests: bool
    guest_uids: str
    guest_run_dir: str
    guest_pids_max: int
    guest_cwd_roots: tuple[str, ...]
    guest_writable_roots: tuple[str, ...]
    guest_host_network: bool
    guest_subuids: bool
    logs_max_bytes: int
    logs_total_bytes: int
    logs_retention: float
    state_min_free: int
    dev_root: str
    lane_host_command: tuple[str, ...]
    max_kernel_seconds: float
    log_level: LogLevel
    log_format: LogFormat
    kubelet_plugin: bool = False
    kube_node_name: str = ""
    kubelet_dir: str = "/var/lib/kubelet"
    cdi_dir: str = "/var/run/cdi"
    kube_shared_gpus: tuple[str, ...] = ()

    @property
    def listen_host(self) -> str:
        return split_listen(self.listen)[0]

    @property
    def listen_port(self) -> int:
        return split_listen(self.listen)[1]


def parse_size(text: str) -> int:
    """Bytes from `1073741824`, `512MiB`, `2GiB`, `1.5GB`; ValueError otherwise."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError("expected a size such as 2GiB or a number of bytes")
    unit = (match.group(2) or "b").lower()
    return int(float(match.group(1)) * _UNITS[unit])


def split_listen(listen: str) -> tuple[str, int]:
    """(host, port) of `host:port` or `[v6]:port`; ValueError when malformed."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError("expected host:port")
    port = int(port_text)
    if port > 65535:
        raise ValueError("port out of range")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        ipaddress.IPv6Address(host)
    elif not host:
        raise ValueError("expected host:port")
    else:
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            if not _HOSTNAME.match(host):
                raise ValueError("not an IP address or host name") from None
    return host, port


def _check_url(url: str) -> str:
    if not url:
        return url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http:// or https:// URL")
    return url


def _positive(value: float) -> float:
    if value <= 0:
        raise ValueError("must be greater than 0")
    return value


def _non_negative(value: _Num) -> _Num:
    if value < 0:
        raise ValueError("must not be negative")
    return value


def _node_id(value: str) -> str:
    value = value or socket.gethostname().split(".")[0] or "node"
    if not _NODE_ID.match(value):
        raise ValueError("use 1-63 letters, digits, '.', '_' or '-'")
    return value


def _xids(value: list[Any]) -> tuple[int, ...]:
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 < x < 2**16 for x in value):
        raise ValueError("expected a JSON array of XID numbers")
    return tuple(sorted(set(value)))


def _command(value: list[Any]) -> tuple[str, ...]:
    if not all(isinstance(x, str) and x and "\0" not in x for x in value):
        raise ValueError("expected a JSON array of non-empty strings")
    if value and not value[0].startswith("/"):
        raise ValueError("the program must be an absolute path")
    return tuple(value)


def _ttl(value: float) -> float:
    if not 0 < value <= MAX_TOKEN_TTL:
        raise ValueError(f"must be in (0, {MAX_TOKEN_TTL:.0f}] seconds")
    return value


def _uid_range(text: str) -> str:
    try:
        parse_uid_range(text)
    except UidRangeError as exc:
        raise ValueError(str(exc)) from None
    return text


def _absolute(text: str) -> str:
    if not text.startswith("/"):
        raise ValueError("must be an absolute path")
    return text


def _absolute_or_empty(text: str) -> str:
    return _absolute(text) if text else text


def _folders(value: list[Any]) -> tuple[str, ...]:
    if not all(isinstance(x, str) and x.startswith("/") and "\0" not in x for x in value):
        raise ValueError("expected a JSON array of absolute paths")
    return tuple(dict.fromkeys(os.path.normpath(x) for x in value))


def _kube_node_name(text: str) -> str:
    if text and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", text):
        raise ValueError("expected a Kubernetes node name (a lower-case DNS subdomain)")
    return text


def _strings(value: list[Any]) -> tuple[str, ...]:
    if not all(isinstance(x, str) and x for x in value):
        raise ValueError("expected a JSON array of strings")
    return tuple(dict.fromkeys(value))


def _kernel_seconds(value: float) -> float:
    # A day at most: the edge waits for a kernel as long as it may run.
    if not 0 < value <= 86400:
        raise ValueError("must be above 0 and at most 86400 seconds")
    return value


_CHECKS: dict[str, Any] = {
    "listen": lambda v: split_listen(v) and v,
    "node_id": _node_id,
    "devices": DeviceMode,
    "reserved_cpu": _non_negative,
    "reserved_memory": lambda v: _non_negative(parse_size(v)),
    "vram_headroom": lambda v: _non_negative(parse_size(v)),
    "fatal_xids": _xids,
    "recovery_probes": lambda v: int(_positive(v)),
    "max_queued": lambda v: int(_positive(v)),
    "max_running": lambda v: int(_positive(v)),
    "token_ttl": _ttl,
    "scheduler_url": _check_url,
    "telemetry_interval": _positive,
    "telemetry_bearer_file": _absolute_or_empty,
    "health_interval": _positive,
    "shutdown_grace": _non_negative,
    "kill_grace": _non_negative,
    "sandbox_pool": lambda v: int(_non_negative(v)),
    "state_lock_wait": _non_negative,
    "idempotency_window": _positive,
    "idempotency_max_ids": lambda v: int(_positive(v)),
    "http_read_timeout": _positive,
    "http_body_timeout": _positive,
    "http_keep_alive": _positive,
    "guest_uids": _uid_range,
    "guest_run_dir": _absolute_or_empty,
    "guest_pids_max": lambda v: int(_positive(v)),
    "guest_cwd_roots": _folders,
    "guest_writable_roots": _folders,
    "logs_max_bytes": lambda v: _non_negative(parse_size(v)),
    "logs_total_bytes": lambda v: _non_negative(parse_size(v)),
    "logs_retention": _positive,
    "state_min_free": lambda v: _non_negative(parse_size(v)),
    "dev_root": _absolute,
    "lane_host_command": _command,
    "max_kernel_seconds": _kernel_seconds,
    "log_level": LogLevel,
    "log_format": LogFormat,
    "kube_node_name": _kube_node_name,
    "kubelet_dir": _absolute,
    "cdi_dir": _absolute,
    "kube_shared_gpus": _strings,
}


def build_config(typed: Mapping[str, Any]) -> Config:
    """Validate the typed flag map; one FlagError lists every bad flag.

    Flags are named by their long form, the field name with hyphens (a test
    pins that every flag's first alias is spelled so).
    """
    fields: dict[str, Any] = {}
    problems: list[str] = []
    for name in Config.__struct_fields__:
        shown = name.replace("_", "-")
        if name not in typed:
            problems.append(f"--{shown}: missing value")
            continue
        check = _CHECKS.get(name)
        try:
            fields[name] = check(typed[name]) if check else typed[name]
        except ValueError as exc:
            problems.append(f"--{shown}: {exc} (got {typed[name]!r})")
    if fields.get("kubelet_plugin") and not fields.get("kube_node_name"):
        problems.append("--kubelet-plugin: needs --kube-node-name (the DaemonSet's spec.nodeName)")
    if problems:
        raise FlagError("; ".join(problems))
    return Config(**fields)
