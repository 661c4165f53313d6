"""Benchmarks: each case counts its FLOPs and bytes and is reported against this machine's measured limits.

    machine.measure_machine()   memory read bandwidth and GEMM peak, once per run
    layer.run_layer_bench()     one MoE layer, every available experts backend, a list of token counts
"""
from cpumoe.bench.machine import MachineInfo, measure_machine

__all__ = ["MachineInfo", "measure_machine"]
