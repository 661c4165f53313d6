"""This machine's limits, measured once per run: what every benchmark figure is compared against.

    memory read bandwidth: cpumoe's multi-threaded streaming read of a 1 GiB buffer (best of 5), GB/s
    GEMM peak:             torch.mm of 4096 x 4096 x 4096 in the benchmark's dtype (median after warm-up), GFLOP/s
Both run on torch's thread count. OtherCpuUse says how much of the CPUs other processes (or the hypervisor) took
while a run went on: on a shared machine, that work lowers every figure.
`quick` uses a 256 MiB buffer and a 2048-cube GEMM (seconds less, a rougher peak).
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from cpumoe import ops


@dataclass(frozen=True, slots=True)
class MachineInfo:
    cpu: str
    features: list[str]
    threads: int
    bandwidth_gbs: float     # best streaming read, GB/s (1e9 bytes)
    mm_gflops: float         # median torch.mm GFLOP/s
    mm_dtype: str
    mm_size: int             # the GEMM is mm_size^3
    torch_version: str

    def to_dict(self) -> dict:
        return asdict(self)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what the platform module says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_bandwidth(nbytes: int = 1 << 30, repetitions: int = 5) -> float:
    best, _median = ops.measure_read_bandwidth(nbytes, repetitions=repetitions)
    return best


def measure_mm_peak(dtype: torch.dtype = torch.bfloat16, size: int = 4096, repetitions: int = 3) -> float:
    a = torch.randn(size, size).to(dtype)  # [N, N]
    b = torch.randn(size, size).to(dtype)  # [N, N]
    torch.mm(a, b)  # warm-up
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e9


def measure_machine(dtype: torch.dtype = torch.bfloat16, quick: bool = False) -> MachineInfo:
    mm_size = 2048 if quick else 4096
    return MachineInfo(
        cpu=cpu_model(), features=ops.cpu_features(), threads=torch.get_num_threads(),
        bandwidth_gbs=measure_bandwidth(1 << 28 if quick else 1 << 30, repetitions=3 if quick else 5),
        mm_gflops=measure_mm_peak(dtype, mm_size), mm_dtype=str(dtype).removeprefix("torch."), mm_size=mm_size,
        torch_version=torch.__version__)


class OtherCpuUse:
    """Context manager: `fraction` of all CPUs' time that went to anything but this process while the block ran
    (None where /proc/stat is missing, or the block took under MIN_WALL_S: /proc/stat counts in 10 ms ticks).
    Busy time = user + nice + system + irq + softirq + steal."""

    MIN_WALL_S = 1.0

    def __init__(self) -> None:
        self.fraction: float | None = None

    def __enter__(self) -> OtherCpuUse:
        self._start = (time.monotonic(), _system_busy_s(), _own_cpu_s())
        return self

    def __exit__(self, *exc) -> None:
        wall0, busy0, own0 = self._start
        wall, busy, own = time.monotonic() - wall0, _system_busy_s(), _own_cpu_s() - own0
        if busy0 is not None and busy is not None and wall >= self.MIN_WALL_S:
            self.fraction = min(1.0, max(0.0, (busy - busy0 - own) / (wall * (os.cpu_count() or 1))))


def _system_busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system
