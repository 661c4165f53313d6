"""cpumoe: Mixture-of-Experts inference on CPUs.

    cpumoe.select_experts   routing (softmax/sigmoid top-k, grouped top-k, ...)
    cpumoe.FusedMoE         the experts layer, run by the fastest kernel path this CPU supports
    cpumoe.reference        plain PyTorch versions of the same maths
"""
from cpumoe.logs import configure_from_env
from cpumoe import ops  # noqa: F401  (registers torch.ops.cpumoe and its fake kernels)
from cpumoe.layer import FusedMoE
from cpumoe.routing import select_experts

__all__ = ["FusedMoE", "select_experts"]
__version__ = "0.1.0"

configure_from_env()
