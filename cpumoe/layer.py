"""cpumoe.FusedMoE: a Mixture-of-Experts experts layer as an nn.Module.

    router_logits -> select_experts -> [chosen backend: pack once at construction] -> fused experts -> [M, H]

(On a native backend, called eagerly, routing and the experts run as one native call, bound at construction:
csrc/torch/routed_experts.inc.)

Weights are float tensors, float tensors quantized at construction (quant="int8_w8a8" | "int4_w4a16" |
"fp8_w8a16" | "mxfp4_w4a16"), or already-quantized cpumoe.quant.QuantizedWeight stacks (FusedMoE.from_quantized).
"""
from __future__ import annotations

import torch
from torch import nn

from cpumoe.experts import ExpertsConfig, choose_backend, rows_independent_backend
from cpumoe.experts.base import ExpertReader, QuantExpertReader
from cpumoe.quant import QuantFormat, QuantizedWeight, parse_format, quantize
from cpumoe.routing import select_experts


class FusedMoE(nn.Module):
    """Experts of one MoE layer, run by the fastest backend this machine supports: `self.impl` is that
    ExpertsBackend, `self.backend` its name.

    w13 [E, 2I, H] holds each expert's gate rows then up rows; w2 [E, H, I]. With `expert_map`
    ([num_experts] int, global id -> local row of w13/w2, -1 = not on this shard), w13/w2 hold only the local
    experts and `num_experts` is the global count.

    With `expert_reader` (e -> (w13_e [2I, H], w2_e [H, I])), w13 and w2 may be meta tensors that only give
    the shapes and dtype: the backend then packs expert by expert as it reads them, so a checkpoint loader never
    holds a whole layer of unpacked experts.
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, *, top_k: int, activation: str = "silu",
                 renormalize: bool = True, scoring: str = "softmax", w13_bias: torch.Tensor | None = None,
                 w2_bias: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
                 num_experts: int | None = None, apply_router_weight_on_input: bool = False,
                 num_expert_group: int | None = None, topk_group: int | None = None,
                 e_score_correction_bias: torch.Tensor | None = None, routed_scaling_factor: float = 1.0,
                 backend: str = "auto", expert_reader: ExpertReader | None = None,
                 quant: str | QuantFormat | None = None, group_size: int | None = None,
                 dtype: torch.dtype | None = None):
        """quant/group_size: quantize w13/w2 to that format now. dtype: the activations' dtype of a quantized
        layer (default: the float weights' dtype for int8/int4/mxfp4, bfloat16 for fp8, which takes only that)."""
        super().__init__()
        quantized = isinstance(w13, QuantizedWeight)
        if quant is not None and not quantized:  # quantize the float weights now, as cpumoe.quant.quantize does
            if expert_reader is not None:
                raise ValueError("quant= quantizes given weights; with an expert_reader use from_quantized")
            fmt = parse_format(quant)
            dtype = dtype or (w13.dtype if fmt.int8_activations else torch.bfloat16)
            w13, w2 = quantize(w13, fmt, group_size), quantize(w2, fmt, group_size)
            quantized = True
        if quantized:
            dtype = dtype or torch.bfloat16
            _check_quantized(w13, w2, w13_bias, w2_bias)
        else:
            _check_weights(w13, w2, w13_bias, w2_bias)
            if dtype is not None and dtype != w13.dtype:
                raise ValueError(f"dtype={dtype} differs from the unquantized weights' {w13.dtype}")
            dtype = w13.dtype
        local_experts, two_inter, hidden = w13.shape
        self.num_experts = num_experts if num_experts is not None else local_experts
        if expert_map is not None:
            expert_map = torch.as_tensor(expert_map).to(torch.int32).contiguous()
            if expert_map.shape != (self.num_experts,):
                raise ValueError(f"expert_map must have shape [num_experts={self.num_experts}], got {list(expert_map.shape)}")
            if int(expert_map.max()) >= local_experts or int(expert_map.min()) < -1:
                raise ValueError(f"expert_map values must be -1 or local ids in [0, {local_experts})")
        elif self.num_experts != local_experts:
            raise ValueError(f"num_experts={self.num_experts} differs from w13's {local_experts} experts "
                             "but no expert_map says where they are")
        if e_score_correction_bias is not None and tuple(e_score_correction_bias.shape) != (self.num_experts,):
            raise ValueError(f"e_score_correction_bias must be [num_experts={self.num_experts}], "
                             f"got {list(e_score_correction_bias.shape)}")
        self.top_k = top_k
        self.routing = dict(scoring=scoring, renormalize=renormalize, num_expert_group=num_expert_group,
                            topk_group=topk_group, e_score_correction_bias=e_score_correction_bias,
                            routed_scaling_factor=routed_scaling_factor)
        self.expert_map = expert_map
        self.config = ExpertsConfig(
            hidden_size=hidden, inter_size=two_inter // 2, num_experts=local_experts, top_k=top_k, dtype=dtype,
            activation=activation, has_bias=w13_bias is not None or w2_bias is not None,
            expert_parallel=expert_map is not None, apply_router_weight_on_input=apply_router_weight_on_input,
            quantization=w13.format.value if quantized else "none",
            group_size=_op_group(w13, w2) if quantized else 0)
        self.impl = choose_backend(self.config, backend)
        if quantized and expert_reader is None:
            self.prepared = self.impl.prepare_quantized(self.config, w13, w2, w13_bias, w2_bias)
        elif quantized:
            self.prepared = self.impl.prepare_quantized_experts(self.config, local_experts,
                                                                _checked_quantized(expert_reader, w13, w2),
                                                                w13_bias, w2_bias)
        elif expert_reader is None:
            if w13.is_meta or w2.is_meta:
                raise ValueError("w13 and w2 are meta tensors (shapes without data): pass real weights, or an "
                                 "expert_reader that reads each expert's")
            self.prepared = self.impl.prepare(w13, w2, w13_bias, w2_bias)
        else:
            self.prepared = self.impl.prepare_experts(local_experts, _checked(expert_reader, w13, w2), w13_bias,
                                                      w2_bias)
        self._bind_routed()

    def _bind_routed(self) -> None:
        self._routed = self.impl.bind_routed(self.prepared, self.config, self.num_experts, self.routing,
                                             self.expert_map)

    @classmethod
    def from_quantized(cls, w13: QuantizedWeight | None, w2: QuantizedWeight | None, *, top_k: int,
                       dtype: torch.dtype = torch.bfloat16, num_local_experts: int | None = None,
                       expert_reader: QuantExpertReader | None = None, **kwargs) -> FusedMoE:
        """A layer over already-quantized weights, as a checkpoint loader has them: w13 [E, 2I, H] and w2 [E, H, I]
        QuantizedWeight stacks, or (w13=w2=None) num_local_experts and expert_reader(e) -> (w13_e, w2_e), read
        and packed one expert at a time. dtype: of the activations (fp8, an A16 format, takes bfloat16)."""
        if w13 is None or w2 is None:
            if expert_reader is None or not num_local_experts:
                raise ValueError("from_quantized needs w13 and w2, or num_local_experts and an expert_reader")
            first13, first2 = expert_reader(0)
            w13, w2 = first13.meta_stack(num_local_experts), first2.meta_stack(num_local_experts)
        return cls(w13, w2, top_k=top_k, expert_reader=expert_reader, dtype=dtype, **kwargs)

    def make_batch_invariant(self) -> None:
        """Run on a backend whose rows never depend on how many share a call (rows_independent_backend); the packed
        weights stay as they are."""
        self.impl = rows_independent_backend(self.config, self.impl)
        self._bind_routed()

    @property
    def quantization(self) -> str:
        """The weights' format ("none" when unquantized)."""
        return self.config.quantization

    @property
    def backend(self) -> str:
        """The name of the backend that runs the experts (`self.impl.name`)."""
        return self.impl.name

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        # Eagerly, the bound native call (None for tensors it was not made for); tracing and torch.compile take the
        # ops below. Its checks are made once, so at M = 1 a call costs ~0.1 ms less with its code out of the caches.
        if self._routed is not None and type(hidden_states) is torch.Tensor and not torch.compiler.is_compiling():
            out = self._routed(hidden_states, router_logits)
            if out is not None:
                return out
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.config.hidden_size:
            raise ValueError(f"hidden_states must be [M, {self.config.hidden_size}], got {list(hidden_states.shape)}")
        if hidden_states.dtype != self.config.dtype:
            raise ValueError(f"hidden_states dtype {hidden_states.dtype} differs from the weights' {self.config.dtype}")
        if router_logits.shape != (hidden_states.shape[0], self.num_experts):
            raise ValueError(f"router_logits must be [M={hidden_states.shape[0]}, E={self.num_experts}], "
                             f"got {list(router_logits.shape)}")
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, **self.routing)
        return self.experts(hidden_states, topk_weights, topk_ids)

    def experts(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The layer after routing: for callers that route themselves."""
        return self.impl.apply(self.prepared, self.config, hidden_states, topk_weights, topk_ids, self.expert_map)

    def extra_repr(self) -> str:
        c = self.config
        quant = f", quantization={c.quantization}" if c.quantization != "none" else ""
        return (f"experts={self.num_experts}, hidden={c.hidden_size}, inter={c.inter_size}, top_k={c.top_k}, "
                f"dtype={c.dtype}{quant}, activation={c.activation}, backend={self.backend}")


def _checked(read_expert: ExpertReader, w13: torch.Tensor, w2: torch.Tensor) -> ExpertReader:
    """read_expert, checking each expert against the declared shapes and dtype."""
    def read(e: int):
        w13_e, w2_e = read_expert(e)
        if w13_e.shape != w13.shape[1:] or w2_e.shape != w2.shape[1:] or w13_e.dtype != w13.dtype \
                or w2_e.dtype != w2.dtype:
            raise ValueError(f"expert {e}: w13 {list(w13_e.shape)} {w13_e.dtype} and w2 {list(w2_e.shape)} "
                             f"{w2_e.dtype}, expected {list(w13.shape[1:])} and {list(w2.shape[1:])} {w13.dtype}")
        return w13_e, w2_e
    return read


def _check_weights(w13, w2, w13_bias, w2_bias) -> None:
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I]; got {list(w13.shape)} and {list(w2.shape)}")
    _check_shapes(tuple(w13.shape), tuple(w2.shape), w13_bias, w2_bias)
    if w13.dtype != w2.dtype or w13.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"w13 and w2 must share one dtype of float32/bfloat16/float16, got {w13.dtype}, {w2.dtype}")


def _check_shapes(w13_shape, w2_shape, w13_bias, w2_bias) -> None:
    E, two_inter, hidden = w13_shape
    if two_inter % 2:
        raise ValueError(f"w13's second dimension must be 2*I (gate rows then up rows), got {two_inter}")
    if tuple(w2_shape) != (E, hidden, two_inter // 2):
        raise ValueError(f"w2 must be [E={E}, H={hidden}, I={two_inter // 2}] to match w13 {list(w13_shape)}, "
                         f"got {list(w2_shape)}")
    if w13_bias is not None and w13_bias.shape != (E, two_inter):
        raise ValueError(f"w13_bias must be [E={E}, 2I={two_inter}], got {list(w13_bias.shape)}")
    if w2_bias is not None and w2_bias.shape != (E, hidden):
        raise ValueError(f"w2_bias must be [E={E}, H={hidden}], got {list(w2_bias.shape)}")


def _op_group(w13: QuantizedWeight, w2: QuantizedWeight) -> int:
    """The one group size the kernels take for both matrices: the format's group, or 0 for a whole row."""
    if w13.group_size == w2.group_size:
        return w13.group_size
    if w13.group_size == w13.shape[-1] and w2.group_size == w2.shape[-1]:
        return 0
    raise ValueError(f"w13 and w2 must share a group size (or both be per channel), got {w13.group_size} and "
                     f"{w2.group_size}")


def _check_quantized(w13: QuantizedWeight, w2: QuantizedWeight, w13_bias, w2_bias) -> None:
    if not isinstance(w2, QuantizedWeight) or w13.format is not w2.format:
        raise ValueError("w13 and w2 must be QuantizedWeights of one format")
    if w13.qweight.device.type != "meta":
        w13.validate("w13")
        w2.validate("w2")
    if len(w13.shape) != 3 or len(w2.shape) != 3:
        raise ValueError(f"quantized w13 must be [E, 2I, H] and w2 [E, H, I]; got {list(w13.shape)} and "
                         f"{list(w2.shape)}")
    _check_shapes(w13.shape, w2.shape, w13_bias, w2_bias)


def _checked_quantized(read_expert: QuantExpertReader, w13: QuantizedWeight, w2: QuantizedWeight) -> QuantExpertReader:
    """read_expert, checking each expert against the declared format and shapes."""
    def read(e: int):
        w13_e, w2_e = read_expert(e)
        for name, got, want in (("w13", w13_e, w13), ("w2", w2_e, w2)):
            if got.format is not want.format or got.shape != want.shape[1:] or got.group_size != want.group_size:
                raise ValueError(f"expert {e}: {name} is {got.format.value} {list(got.shape)} group {got.group_size}, "
                                 f"expected {want.format.value} {list(want.shape[1:])} group {want.group_size}")
            got.validate(f"expert {e} {name}")
        return w13_e, w2_e
    return read
