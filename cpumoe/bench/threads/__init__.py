"""`cpumoe bench threads`: the fused experts op and the decode step at 1, 2, 4, ... threads (see run.py)."""
from cpumoe.bench.threads.run import ThreadsRow, render_thread_scaling, row_from_reports, run_thread_scaling

__all__ = ["ThreadsRow", "render_thread_scaling", "row_from_reports", "run_thread_scaling"]
