"""A node's GPUs, from nvidia-smi's CSV query: what preflight shows, and whether a stopped worker
really gave its GPU memory back (vLLM's engine-core children can outlive the API server)."""

from __future__ import annotations

from dataclasses import dataclass

from thunderctl.cluster.transport import Transport
from thunderctl.processes import poll_until

NVIDIA_SMI_QUERY = "nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.free --format=csv,noheader"
COMMAND_NOT_FOUND = 127
# Before a start: a GPU with less free than this share of its memory is used by someone else
# (vLLM's default --gpu-memory-utilization 0.9 would not fit beside it).
START_FREE_SHARE = 0.9
# After a stop: an idle H100 shows ~99% free; a worker that left a process behind holds far more.
RELEASED_FREE_SHARE = 0.95
RELEASE_WAIT_S = 15.0
RELEASE_POLL_S = 1.0


class GpuQueryError(RuntimeError):
    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    driver: str
    total_mib: int
    free_mib: int

    @property
    def free_share(self) -> float:
        return self.free_mib / self.total_mib

    def memory_text(self) -> str:
        return f"GPU {self.index}: {self.free_mib / 1024:.1f} of {self.total_mib / 1024:.1f} GiB free"


def mib(field: str) -> int:
    """'81559 MiB' → 81559."""
    number, unit = field.split()
    if unit != "MiB":
        raise ValueError(f"unexpected unit {unit!r}")
    return int(number)


def parse_gpus(csv: str) -> list[Gpu]:
    """The output of NVIDIA_SMI_QUERY: one `index, name, driver, total MiB, free MiB` line per GPU."""
    gpus = []
    for line in csv.splitlines():
        if not line.strip():
            continue
        fields = [field.strip() for field in line.split(",")]
        try:
            index, name, driver, total, free = fields
            gpus.append(Gpu(int(index), name, driver, mib(total), mib(free)))
        except ValueError:
            raise GpuQueryError(
                f"unexpected nvidia-smi line {line!r}",
                "check nvidia-smi on the node; a GPU that reports [N/A] may need a reset",
            ) from None
    return gpus


def query_gpus(transport: Transport) -> list[Gpu]:
    result = transport.run(NVIDIA_SMI_QUERY)
    if result.exit_code == COMMAND_NOT_FOUND:
        raise GpuQueryError(
            "nvidia-smi not found", "install the NVIDIA driver on the node, or set gpus: 0 for a CPU node"
        )
    if not result.ok:
        said = (result.stdout + result.stderr).strip().splitlines()
        raise GpuQueryError(
            f"nvidia-smi failed: {said[0] if said else f'exit {result.exit_code}'}",
            "check the driver with nvidia-smi on the node (after a driver upgrade it needs a reboot)",
        )
    return parse_gpus(result.stdout)


def describe(gpus: list[Gpu]) -> str:
    """'8 × NVIDIA H100 80GB HBM3, driver 550.54.15, 79.1-79.1 GiB free'."""
    if not gpus:
        return "no GPU"
    kinds = sorted({gpu.name for gpu in gpus})
    names = ", ".join(f"{sum(g.name == kind for g in gpus)} × {kind}" for kind in kinds)
    drivers = ", ".join(sorted({gpu.driver for gpu in gpus}))
    free = [gpu.free_mib / 1024 for gpu in gpus]
    return f"{names}, driver {drivers}, {min(free):.1f}-{max(free):.1f} GiB free"


def short_of_memory(gpus: list[Gpu], indices: list[int], share: float) -> list[Gpu]:
    """The GPUs among `indices` with less than `share` of their memory free."""
    return [gpu for gpu in gpus if gpu.index in indices and gpu.free_share < share]


def wait_released(transport: Transport, indices: list[int], timeout: float = RELEASE_WAIT_S) -> list[Gpu]:
    """After a stop, wait for the driver to hand the memory back; returns the GPUs still held."""
    held: list[Gpu] = []

    def released() -> bool:
        nonlocal held
        held = short_of_memory(query_gpus(transport), indices, RELEASED_FREE_SHARE)
        return not held

    poll_until(released, timeout, RELEASE_POLL_S)
    return held
