"""Expert paths and the oracle that picks one (see oracle.py)."""
from cpumoe.experts.base import ExpertsConfig, ExpertsPath, PreparedExperts
from cpumoe.experts.oracle import NoSupportedPath, all_paths, choose_path, path_report

__all__ = ["ExpertsConfig", "ExpertsPath", "PreparedExperts", "NoSupportedPath", "all_paths", "choose_path",
           "path_report"]
