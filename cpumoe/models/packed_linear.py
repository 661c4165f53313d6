"""Dense projections on cpumoe's kernels: after loading, each nn.Linear of a model (routers too) becomes a
PackedLinear whose weight is packed once for the fastest kernel backend of its dtype. At decode sizes these
projections are weight streams like the experts, and the kernels read them near the memory bandwidth
(about 1.7x torch's bf16 linear at batch 1 here); at prefill sizes they run at the GEMM's rate.

With backend="naive" (the baseline) the model keeps torch's nn.Linear.

QuantizedLinear is the same for a projection a quantized checkpoint stores quantized: its codes and scales are
packed for the fastest backend that runs the format (cpumoe.experts' oracle, as for experts), or, when only the
naive backend can (backend="naive", or fp8/mxfp4 in a float32 model), dequantized to the model dtype, which the log
says.
"""
from __future__ import annotations

import torch
from torch import nn

from cpumoe import ops
from cpumoe.experts import ExpertsConfig, choose_backend, rows_independent_backend
from cpumoe.experts.oracle import find_backend
from cpumoe.logs import logger
from cpumoe.quant import QuantizedWeight, dequantize

# Routers keep `.weight` beside the packed copy: some models compute them in float32 from it (and they are tiny).
ROUTER_NAMES = ("gate", "shared_expert_gate")


class PackedLinear(nn.Module):
    """y = x W^T (+ bias) for W [N, K], packed for `backend` (linear_backend: the fastest of W's dtype)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: str | None = None,
                 keep_weight: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.backend = linear_backend(weight.dtype) if backend is None else backend
        self.register_buffer("packed_weight", ops.pack_linear(weight.detach().contiguous(), self.backend),
                             persistent=False)
        self.weight = weight if keep_weight else None
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_packed(cls, packed_weight: torch.Tensor, *, out_features: int, in_features: int, backend: str,
                    bias: torch.Tensor | None) -> "PackedLinear":
        """A PackedLinear over a weight packed already (join_linears)."""
        linear = cls.__new__(cls)
        nn.Module.__init__(linear)
        linear.out_features, linear.in_features, linear.backend = out_features, in_features, backend
        linear.register_buffer("packed_weight", packed_weight, persistent=False)
        linear.weight = None
        linear.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        return linear

    def make_batch_invariant(self) -> None:
        """As FusedMoE.make_batch_invariant: a backend whose rows never depend on the call's row count."""
        config = ExpertsConfig(hidden_size=64, inter_size=64, num_experts=1, top_k=1, dtype=self.packed_weight.dtype)
        self.backend = rows_independent_backend(config, find_backend(self.backend)).name

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        return ops.linear(x.contiguous(), self.packed_weight, self.bias, backend=self.backend,
                          out_features=self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, backend={self.backend}"


class QuantizedLinear(nn.Module):
    """y = x W^T (+ bias) with W a QuantizedWeight [N, K], run quantized (linear_quant) on the chosen backend."""

    def __init__(self, weight: QuantizedWeight, *, has_bias: bool, dtype: torch.dtype, backend: str = "auto"):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.format = weight.format
        self.activation_dtype = dtype
        self.group_size = 0 if weight.group_size == self.in_features else weight.group_size  # 0: a whole row
        config = ExpertsConfig(hidden_size=self.in_features, inter_size=self.out_features, num_experts=1, top_k=1,
                               dtype=dtype, quantization=weight.format.value, group_size=self.group_size)
        self.backend = choose_backend(config, backend).name
        if self.backend == "naive":
            logger.info("a %s linear [%d, %d] is dequantized to %s: no native backend runs it here",
                        weight.format.value, self.out_features, self.in_features, dtype)
            self.register_buffer("dense_weight", dequantize(weight).to(dtype), persistent=False)
            self.packed_weight = None
        else:
            weight.validate()
            packed = ops.pack_quant(weight.qweight[None].contiguous(), weight.scales[None].contiguous(),
                                    None if weight.zeros is None else weight.zeros[None].contiguous(),
                                    format=weight.format.value, group_size=self.group_size, w13=False)
            self.register_buffer("packed_weight", packed, persistent=False)
            self.dense_weight = None
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype, device="meta"), requires_grad=False) \
            if has_bias else None

    @classmethod
    def from_packed(cls, packed_weight: torch.Tensor, *, like: "QuantizedLinear", out_features: int,
                    bias: torch.Tensor | None) -> "QuantizedLinear":
        """A QuantizedLinear of `like`'s format, group and backend over a weight packed already (join_linears)."""
        linear = cls.__new__(cls)
        nn.Module.__init__(linear)
        linear.out_features, linear.in_features = out_features, like.in_features
        linear.format, linear.group_size, linear.backend = like.format, like.group_size, like.backend
        linear.activation_dtype = like.activation_dtype
        linear.register_buffer("packed_weight", packed_weight, persistent=False)
        linear.dense_weight = None
        linear.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        return linear

    def make_batch_invariant(self) -> None:
        """As FusedMoE.make_batch_invariant (a dequantized linear runs torch's GEMM: CausalLM refuses it)."""
        if self.packed_weight is not None:
            config = ExpertsConfig(hidden_size=self.in_features, inter_size=self.out_features, num_experts=1, top_k=1,
                                   dtype=self.activation_dtype, quantization=self.format.value,
                                   group_size=self.group_size)
            self.backend = rows_independent_backend(config, find_backend(self.backend)).name

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if self.packed_weight is None:
            return torch.nn.functional.linear(x, self.dense_weight, self.bias)
        return ops.linear_quant(x, self.packed_weight, self.bias, backend=self.backend, format=self.format.value,
                                group_size=self.group_size, out_features=self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format.value}, "
                f"backend={self.backend}")


def join_linears(parts: list[nn.Module]) -> PackedLinear | QuantizedLinear:
    """One projection whose output is the parts' outputs side by side (q, k and v: one weight stream and one call
    where there were three), made from their packed weights without repacking them (ops.join_packed_rows). A
    ValueError says why parts cannot join: not all PackedLinear or all QuantizedLinear on one backend, a
    dequantized one, or a packing they do not share or whose rows do not fill its blocks."""
    first = parts[0]
    kinds = {type(p) for p in parts}
    if len(kinds) > 1 or not kinds <= {PackedLinear, QuantizedLinear}:
        raise ValueError(f"only cpumoe's packed projections of one kind join, got {sorted(k.__name__ for k in kinds)}")
    if any(p.packed_weight is None for p in parts):
        raise ValueError("a dequantized projection (torch's GEMM) does not join")
    if any(p.backend != first.backend for p in parts):
        raise ValueError(f"the projections run on different backends: {[p.backend for p in parts]}")
    packed = ops.join_packed_rows([p.packed_weight for p in parts])
    biases = [p.bias for p in parts]
    bias = None if all(b is None for b in biases) else torch.cat(
        [torch.zeros(p.out_features, dtype=next(b for b in biases if b is not None).dtype) if p.bias is None
         else p.bias.detach() for p in parts])
    out_features = sum(p.out_features for p in parts)
    if isinstance(first, QuantizedLinear):
        return QuantizedLinear.from_packed(packed, like=first, out_features=out_features, bias=bias)
    return PackedLinear.from_packed(packed, out_features=out_features, in_features=first.in_features,
                                    backend=first.backend, bias=bias)


def linear_backend(dtype: torch.dtype, backend: str = "auto") -> str:
    """The kernel backend dense projections of `dtype` run on ("naive" when no native one takes it)."""
    config = ExpertsConfig(hidden_size=64, inter_size=64, num_experts=1, top_k=1, dtype=dtype)
    return choose_backend(config, backend).name


def pack_linears(model: nn.Module, dtype: torch.dtype, backend: str = "auto") -> int:
    """Replace the model's nn.Linear modules by PackedLinear; returns how many."""
    if backend == "naive":
        return 0
    chosen = linear_backend(dtype, backend)
    if chosen == "naive":
        logger.info("dense projections stay torch nn.Linear: no native kernel backend takes %s", dtype)
        return 0
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr,
                PackedLinear(linear.weight, linear.bias, chosen, keep_weight=attr in ROUTER_NAMES))
    return len(targets)
