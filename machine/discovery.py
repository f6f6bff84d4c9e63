"""The one discovery entry point: host facts plus a device backend chosen by mode.

Modes: `nvml` (NVML or no GPU lanes plus a readiness reason), `auto` (the same:
NVML when it initialises and shows GPUs, else no GPU lanes and a reason),
`sim` (the simulator, from a file or the built-in workstation) and `none`
(CPU only, on purpose). `dev` mode falls back to `sim` itself. Discovery never
advertises a GPU it could not initialise (fail closed).
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any

import msgspec
import trio

from machine.discovery_host import discover_host, read_host_memory
from machine.discovery_nvml import NvmlUnavailable, open_nvml
from machine.discovery_sim import SimError, discover_sim, load_sim_spec
from machine.inventory import CpuInfo, Inventory, MemoryInfo

__all__ = ["MODES", "DiscoveryError", "discover"]

# `workstation` is what `dev` uses: NVML when it shows GPUs, else the simulated workstation.
MODES = ("auto", "nvml", "sim", "none", "workstation")


class DiscoveryError(ValueError):
    """Discovery was asked for something impossible (bad mode, bad sim file)."""


def _load_pynvml() -> Any:
    return importlib.import_module("pynvml")


async def discover(
    mode: str,
    *,
    sim_file: Path | None = None,
    pynvml_module: Any = None,
    sys_root: Path = Path("/sys"),
    proc_root: Path = Path("/proc"),
    nvml_call_timeout: float = 5.0,
    host: tuple[CpuInfo, MemoryInfo] | None = None,
) -> Inventory:
    """Discover CPU, memory and devices once. The returned Inventory's `source`
    (when not None) gives later readings and must be closed with `aclose()`.
    `host` stands in for the host's first CPU and memory reading (tests pin it, so
    that the simulated VRAM cap does not depend on the machine they run on)."""
    if mode not in MODES:
        raise DiscoveryError(f"unknown devices mode {mode!r}; expected one of {', '.join(MODES)}")
    if mode == "workstation":
        found = await discover(
            "auto",
            pynvml_module=pynvml_module,
            sys_root=sys_root,
            proc_root=proc_root,
            nvml_call_timeout=nvml_call_timeout,
            host=host,
        )
        if found.gpus:
            return found
        simulated = await discover(
            "sim", sim_file=sim_file, sys_root=sys_root, proc_root=proc_root, host=host
        )
        why = "; ".join(found.readiness_reasons) or "no GPUs"
        return msgspec.structs.replace(
            simulated, notes=(*simulated.notes, f"simulated workstation ({why})")
        )
    # /proc and /sys reads are local and quick; no thread hop needed.
    if host is None:
        host = discover_host(sys_root=sys_root, proc_root=proc_root)
    await trio.lowlevel.checkpoint()
    cpu, memory = host
    host_memory = functools.partial(read_host_memory, sys_root=sys_root, proc_root=proc_root)
    if mode == "none":
        return Inventory(backend="none", cpu=cpu, memory=memory, host_memory=host_memory)
    if mode == "sim":
        try:
            spec = load_sim_spec(sim_file)
        except SimError as exc:
            raise DiscoveryError(str(exc)) from exc
        return await discover_sim(spec, host=host, host_memory=host_memory)
    try:
        nvml = pynvml_module if pynvml_module is not None else _load_pynvml()
        source, gpus, driver, cuda, notes, probes = await open_nvml(
            nvml, call_timeout=nvml_call_timeout
        )
    except (ImportError, NvmlUnavailable) as exc:
        return Inventory(
            backend="none",
            cpu=cpu,
            memory=memory,
            readiness_reasons=(f"nvml_unavailable: {exc}",),
            host_memory=host_memory,
        )
    if not gpus:
        await source.aclose()
        return Inventory(
            backend="none",
            cpu=cpu,
            memory=memory,
            driver_version=driver,
            cuda_version=cuda,
            readiness_reasons=("no_gpus: NVML initialised but reported no GPUs",),
            notes=tuple(notes),
            host_memory=host_memory,
        )
    return Inventory(
        backend="nvml",
        cpu=cpu,
        memory=memory,
        gpus=tuple(gpus),
        driver_version=driver,
        cuda_version=cuda,
        notes=tuple(notes),
        probes=tuple(probes),
        source=source,
        host_memory=host_memory,
    )
