"""Host discovery: psutil facts bounded by (fake) cgroup v2 limits."""

from __future__ import annotations

from pathlib import Path

import psutil  # type: ignore[import-untyped,unused-ignore]

from machine.discovery_host import discover_host, read_cgroup_limits

GiB = 1 << 30


def fake_roots(
    tmp_path: Path,
    *,
    cpu_max: str = "max 100000",
    memory_max: str = "max",
    parent_memory_max: str = "max",
    numa: int = 2,
) -> tuple[Path, Path]:
    sys_root, proc_root = tmp_path / "sys", tmp_path / "proc"
    (proc_root / "self").mkdir(parents=True)
    (proc_root / "self" / "cgroup").write_text("0::/system.slice/litegraph.service\n")
    (proc_root / "cpuinfo").write_text("processor\t: 0\nmodel name\t: Fake CPU @ 3.0GHz\n")
    root = sys_root / "fs" / "cgroup"
    leaf = root / "system.slice" / "litegraph.service"
    leaf.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (leaf / "cpu.max").write_text(cpu_max + "\n")
    (leaf / "memory.max").write_text(memory_max + "\n")
    (leaf / "memory.current").write_text(str(GiB // 2) + "\n")
    (leaf / "memory.stat").write_text(f"anon 1000\ninactive_file {GiB // 4}\n")
    (root / "system.slice" / "memory.max").write_text(parent_memory_max + "\n")
    for i in range(numa):
        (sys_root / "devices" / "system" / "node" / f"node{i}").mkdir(parents=True)
    return sys_root, proc_root


def test_no_limits_uses_host(tmp_path: Path) -> None:
    sys_root, proc_root = fake_roots(tmp_path)
    cpu, mem = discover_host(sys_root=sys_root, proc_root=proc_root)
    logical = psutil.cpu_count(logical=True)
    assert cpu.logical_cores == logical
    assert cpu.capacity_millis <= logical * 1000
    assert cpu.cgroup_limit_millis is None
    assert cpu.model == "Fake CPU @ 3.0GHz" and cpu.numa_nodes == 2
    assert mem.total_bytes == psutil.virtual_memory().total == mem.capacity_bytes
    assert 0 < mem.available_bytes <= mem.total_bytes
    assert mem.cgroup_limit_bytes is None


def test_cgroup_limits_win_when_smaller(tmp_path: Path) -> None:
    sys_root, proc_root = fake_roots(tmp_path, cpu_max="50000 100000", memory_max=str(2 * GiB))
    cpu, mem = discover_host(sys_root=sys_root, proc_root=proc_root)
    assert cpu.capacity_millis == 500 == cpu.cgroup_limit_millis
    assert mem.capacity_bytes == min(2 * GiB, psutil.virtual_memory().total)
    # Inactive file cache is reclaimable: not counted as used.
    assert mem.available_bytes <= 2 * GiB - (GiB // 2 - GiB // 4)


def test_ancestor_limit_applies(tmp_path: Path) -> None:
    sys_root, proc_root = fake_roots(tmp_path, memory_max=str(8 * GiB), parent_memory_max=str(GiB))
    limits = read_cgroup_limits(sys_root=sys_root, proc_root=proc_root)
    assert limits.memory_bytes == GiB


def test_cgroup_larger_than_host_is_ignored(tmp_path: Path) -> None:
    huge = str(1 << 60)
    sys_root, proc_root = fake_roots(tmp_path, cpu_max="100000000 1000", memory_max=huge)
    cpu, mem = discover_host(sys_root=sys_root, proc_root=proc_root)
    assert cpu.capacity_millis <= psutil.cpu_count(logical=True) * 1000
    assert mem.capacity_bytes == psutil.virtual_memory().total


def test_missing_trees_degrade_quietly(tmp_path: Path) -> None:
    cpu, mem = discover_host(sys_root=tmp_path / "nosys", proc_root=tmp_path / "noproc")
    assert cpu.model == "unknown" and cpu.numa_nodes is None and cpu.cgroup_limit_millis is None
    assert mem.capacity_bytes == mem.total_bytes
