"""Random MoE layer problems shared by the kernel tests and the layer benchmark's checks."""
from __future__ import annotations

from dataclasses import dataclass

import torch

import cpumoe
from cpumoe.experts import ExpertsConfig, all_backends


@dataclass(frozen=True)
class MoECase:
    M: int
    H: int
    I: int
    E: int
    k: int

    @property
    def id(self) -> str:
        return f"M{self.M}-H{self.H}-I{self.I}-E{self.E}-k{self.k}"


@dataclass
class MoEProblem:
    x: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None


def make_problem(case: MoECase, dtype: torch.dtype, *, bias: bool = False, seed: int = 0,
                 topk_ids: torch.Tensor | None = None) -> MoEProblem:
    g = torch.Generator().manual_seed(seed)
    M, H, I, E, k = case.M, case.H, case.I, case.E, case.k
    x = torch.randn(M, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    logits = torch.randn(M, E, generator=g)
    weights, ids = cpumoe.select_experts(logits, k, renormalize=True)
    if topk_ids is not None:
        ids = topk_ids.to(torch.int32).contiguous()
    b13 = torch.randn(E, 2 * I, generator=g).to(dtype) if bias else None
    b2 = torch.randn(E, H, generator=g).to(dtype) if bias else None
    return MoEProblem(x, w13, w2, weights, ids, b13, b2)


def runnable_backends(dtype: torch.dtype) -> list[str]:
    """Backends this machine can run for an unquantized layer of `dtype` (native ones and naive)."""
    config = ExpertsConfig(hidden_size=64, inter_size=32, num_experts=2, top_k=1, dtype=dtype)
    return [p.name for p in all_backends() if p.is_supported(config)[0]]


def backend_dtype_grid() -> list:
    import pytest
    return [pytest.param(p, d, id=f"{p}-{str(d).removeprefix('torch.')}")
            for d in (torch.bfloat16, torch.float32, torch.float16) for p in runnable_backends(d)]


def assert_fake_matches(op, args: tuple, kwargs: dict) -> None:
    """The op's fake kernel gives the real output's shape and dtype. (torch.library.opcheck runs the real op on
    copies of the arguments, and the ops refuse a copy of a packed weight, so fake tensors are made here.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = op(*args, **kwargs)
    with FakeTensorMode() as mode:
        fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype)
