"""The oracle: walks the paths fastest first and takes the first that supports the layer.

Every rejection carries its reason; when nothing fits, the error lists them all. The choice is logged once
per distinct layer config, with the reasons the faster paths were passed over."""
from __future__ import annotations

from functools import cache

from cpumoe.experts.base import ExpertsConfig, ExpertsPath
from cpumoe.experts.naive import NaiveExperts
from cpumoe.experts.native import native_paths
from cpumoe.logs import logger as log



class NoSupportedPath(ValueError):
    pass


@cache
def all_paths() -> tuple[ExpertsPath, ...]:
    """Every path, fastest first: the native ones in the library's order, then the naive loop."""
    return (*native_paths(), NaiveExperts())


def find_path(name: str) -> ExpertsPath:
    for p in all_paths():
        if p.name == name:
            return p
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(p.name for p in all_paths())}")


def path_report(config: ExpertsConfig) -> list[tuple[str, bool, str]]:
    """(name, supported, reason) for every path, fastest first."""
    return [(p.name, *p.is_supported(config)) for p in all_paths()]


@cache
def _log_choice(config: ExpertsConfig, chosen: str, passed_over: str) -> None:
    log.info("cpumoe experts: %s for %s%s", chosen, config, f" (passed over: {passed_over})" if passed_over else "")


def choose_path(config: ExpertsConfig, backend: str = "auto") -> ExpertsPath:
    """The fastest path supporting `config` (backend="auto"), or the named one if it supports it."""
    if backend != "auto":
        path = find_path(backend)
        ok, why = path.is_supported(config)
        if not ok:
            raise NoSupportedPath(f"backend {backend!r} cannot run this layer: {why}")
        _log_choice(config, path.name, "")
        return path
    rejected = []
    for path in all_paths():
        ok, why = path.is_supported(config)
        if ok:
            _log_choice(config, path.name, "; ".join(f"{n}: {r}" for n, r in rejected))
            return path
        rejected.append((path.name, why))
    raise NoSupportedPath("no experts path supports this layer:\n" + "\n".join(f"  {n}: {r}" for n, r in rejected))
