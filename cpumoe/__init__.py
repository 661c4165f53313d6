"""cpumoe: Mixture-of-Experts inference on CPUs.

    cpumoe.select_experts   routing (softmax/sigmoid top-k, grouped top-k, ...)
    cpumoe.FusedMoE         the experts layer, run by the fastest kernel backend this CPU supports
    cpumoe.reference        plain PyTorch versions of the same maths
"""
import os

# The kernels run on cpumoe's own worker pool (csrc/core/worker_pool.h); torch's ops on libgomp's threads, which by
# default spin ~8 ms after each parallel region before they sleep, on the core a kernel's helper needs next. A short
# spin still covers back-to-back torch regions. libgomp reads this when torch loads it, so it is set before the import
# (and has no effect when torch was imported first); a value the user set stands.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from cpumoe.logs import configure_from_env
from cpumoe import ops  # noqa: F401  (registers torch.ops.cpumoe and its fake kernels)
from cpumoe.layer import FusedMoE
from cpumoe.routing import select_experts

__all__ = ["FusedMoE", "select_experts"]
__version__ = "0.1.0"

configure_from_env()
