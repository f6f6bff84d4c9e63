"""What `status` and `dev` call a node's GPUs: one count, with the MIG instances named."""

from __future__ import annotations

from machine.inventory import GpuDevice, MigInstance
from node.status_view import gpu_summary

GiB = 2**30


def _gpu(n: int, migs: int = 0) -> GpuDevice:
    instances = tuple(
        MigInstance(uuid=f"MIG-{n}-{m}", name="1g.6gb", memory_total_bytes=6 * GiB)
        for m in range(migs)
    )
    return GpuDevice(
        uuid=f"GPU-{n}",
        name="sim",
        pci_bus_id=None,
        memory_total_bytes=24 * GiB,
        mig_enabled=migs > 0,
        mig_instances=instances,
    )


def test_physical_gpus_are_counted_and_their_mig_instances_named() -> None:
    assert gpu_summary([]) == "0 GPUs"
    assert gpu_summary([_gpu(0)]) == "1 GPU"
    assert gpu_summary([_gpu(0), _gpu(1)]) == "2 GPUs"
    assert gpu_summary([_gpu(0), _gpu(1, migs=1)]) == "2 GPUs (1 MIG instance)"
    assert gpu_summary([_gpu(0), _gpu(1, migs=3)]) == "2 GPUs (3 MIG instances)"
