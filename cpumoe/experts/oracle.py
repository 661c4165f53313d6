"""The oracle: walks the backends fastest first and takes the first that supports the layer.

Every rejection carries its reason; when nothing fits, the error lists them all. The choice is logged once
per distinct layer config, with the reasons the faster backends were passed over."""
from __future__ import annotations

from functools import cache

from cpumoe.experts.base import ExpertsBackend, ExpertsConfig
from cpumoe.experts.naive import NaiveExperts
from cpumoe.experts.native import native_backends
from cpumoe.logs import logger as log



class NoSupportedBackend(ValueError):
    pass


@cache
def all_backends() -> tuple[ExpertsBackend, ...]:
    """Every backend, fastest first: the native ones in the library's order, then the naive loop."""
    return (*native_backends(), NaiveExperts())


def find_backend(name: str) -> ExpertsBackend:
    for p in all_backends():
        if p.name == name:
            return p
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(p.name for p in all_backends())}")


def backend_report(config: ExpertsConfig) -> list[tuple[str, bool, str]]:
    """(name, supported, reason) for every backend, fastest first."""
    return [(p.name, *p.is_supported(config)) for p in all_backends()]


@cache
def _log_choice(config: ExpertsConfig, chosen: str, passed_over: str) -> None:
    log.info("cpumoe experts: %s for %s%s", chosen, config, f" (passed over: {passed_over})" if passed_over else "")


def rows_independent_backend(config: ExpertsConfig, current: ExpertsBackend) -> ExpertsBackend:
    """`current` when its rows never depend on their call's row count, else the fastest backend that supports
    `config`, is row-independent and packs as `current` does (so the packed weights serve it unchanged: quantized
    blocks are the same for every backend, dense ones follow the backend's layout)."""
    if current.rows_independent:
        return current
    layout = getattr(current, "layout", None)
    for impl in all_backends():
        same_packing = config.quantization != "none" or getattr(impl, "layout", None) == layout
        if impl.rows_independent and same_packing and impl.name != "naive" and impl.is_supported(config)[0]:
            log.info("batch-invariant: %s runs on %s in place of %s (whose sums depend on a call's row count)",
                     config.quantization if config.quantization != "none" else config.dtype, impl.name, current.name)
            return impl
    raise NoSupportedBackend(f"no row-independent backend packs as {current.name} does for this layer")


def choose_backend(config: ExpertsConfig, backend: str = "auto") -> ExpertsBackend:
    """The fastest backend supporting `config` (backend="auto"), or the named one if it supports it."""
    if backend != "auto":
        impl = find_backend(backend)
        ok, why = impl.is_supported(config)
        if not ok:
            raise NoSupportedBackend(f"backend {backend!r} cannot run this layer: {why}")
        _log_choice(config, impl.name, "")
        return impl
    rejected = []
    for impl in all_backends():
        ok, why = impl.is_supported(config)
        if ok:
            _log_choice(config, impl.name, "; ".join(f"{n}: {r}" for n, r in rejected))
            return impl
        rejected.append((impl.name, why))
    raise NoSupportedBackend("no experts backend supports this layer:\n" +
                             "\n".join(f"  {n}: {r}" for n, r in rejected))
