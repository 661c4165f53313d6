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
from cpumoe.torch_gemm import gemm_dtype


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


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what the platform module says. An x86 CPU also gets its
    family and model numbers, and AMD's core generation where they tell it: a VM may call every host "AMD EPYC",
    and a Zen 4 and a Zen 5 core differ twofold in bf16 GEMM rate. cpuinfo: the file's text (tests)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's, where each has its own
    name = next((fields[k] for k in ("model name", "Model", "cpu model") if k in fields), None)
    if name is None:
        return platform.processor() or platform.machine()
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):  # not x86 (where "model" may be a name, or absent)
        return name
    core = amd_core(family, model) if fields.get("vendor_id") == "AuthenticAMD" else None
    return f"{name} (family {family}, model {model}{', ' + core if core else ''})"


def amd_core(family: int, model: int) -> str | None:
    """AMD's core generation of a CPU family and model (as /proc/cpuinfo gives them, in decimal); None if unknown.
    Family 0x19 holds both Zen 3 and Zen 4, told apart by the model ranges AMD gives each."""
    if family == 0x1A:
        return "Zen 5"
    if family == 0x19:
        zen4 = any(lo <= model <= hi for lo, hi in ((0x10, 0x1F), (0x60, 0x7F), (0xA0, 0xAF)))
        return "Zen 4" if zen4 else "Zen 3"
    if family == 0x17:
        return "Zen 2" if model >= 0x30 else "Zen / Zen+"
    return None


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
    """The GEMM rate is torch.mm's in dtype, or in float32 where torch has no vector GEMM for dtype on this CPU
    (cpumoe.torch_gemm): the FMA rate the kernels' own float32 accumulation runs at there."""
    dtype = gemm_dtype(dtype)
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
