"""Experts backends and the oracle that picks one (see oracle.py)."""
from cpumoe.experts.base import ExpertsBackend, ExpertsConfig, PreparedExperts
from cpumoe.experts.oracle import (NoSupportedBackend, all_backends, backend_report, choose_backend,
                                   rows_independent_backend)

__all__ = ["ExpertsBackend", "ExpertsConfig", "PreparedExperts", "NoSupportedBackend", "all_backends",
           "backend_report", "choose_backend", "rows_independent_backend"]
