"""cpumoe.FusedMoE: a Mixture-of-Experts experts layer as an nn.Module.

    router_logits -> select_experts -> [chosen path: pack once at construction] -> fused experts -> [M, H]
"""
from __future__ import annotations

import torch
from torch import nn

from cpumoe.experts import ExpertsConfig, choose_path
from cpumoe.experts.base import ExpertReader
from cpumoe.routing import select_experts


class FusedMoE(nn.Module):
    """Experts of one MoE layer, run by the fastest path this machine supports (`self.backend` names it).

    w13 [E, 2I, H] holds each expert's gate rows then up rows; w2 [E, H, I]. With `expert_map`
    ([num_experts] int, global id -> local row of w13/w2, -1 = not on this shard), w13/w2 hold only the local
    experts and `num_experts` is the global count.

    With `expert_reader` (e -> (w13_e [2I, H], w2_e [H, I])), w13 and w2 may be meta tensors that only give
    the shapes and dtype: the path then packs expert by expert as it reads them, so a checkpoint loader never
    holds a whole layer of unpacked experts.
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, *, top_k: int, activation: str = "silu",
                 renormalize: bool = True, scoring: str = "softmax", w13_bias: torch.Tensor | None = None,
                 w2_bias: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
                 num_experts: int | None = None, apply_router_weight_on_input: bool = False,
                 num_expert_group: int | None = None, topk_group: int | None = None,
                 e_score_correction_bias: torch.Tensor | None = None, routed_scaling_factor: float = 1.0,
                 backend: str = "auto", expert_reader: ExpertReader | None = None):
        super().__init__()
        _check_weights(w13, w2, w13_bias, w2_bias)
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
        self.top_k = top_k
        self.routing = dict(scoring=scoring, renormalize=renormalize, num_expert_group=num_expert_group,
                            topk_group=topk_group, e_score_correction_bias=e_score_correction_bias,
                            routed_scaling_factor=routed_scaling_factor)
        self.expert_map = expert_map
        self.config = ExpertsConfig(
            hidden_size=hidden, inter_size=two_inter // 2, num_experts=local_experts, top_k=top_k, dtype=w13.dtype,
            activation=activation, has_bias=w13_bias is not None or w2_bias is not None,
            expert_parallel=expert_map is not None, apply_router_weight_on_input=apply_router_weight_on_input)
        self.path = choose_path(self.config, backend)
        if expert_reader is None:
            self.prepared = self.path.prepare(w13, w2, w13_bias, w2_bias)
        else:
            self.prepared = self.path.prepare_experts(local_experts, _checked(expert_reader, w13, w2), w13_bias,
                                                      w2_bias)

    @property
    def backend(self) -> str:
        return self.path.name

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
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
        return self.path.apply(self.prepared, self.config, hidden_states, topk_weights, topk_ids, self.expert_map)

    def extra_repr(self) -> str:
        c = self.config
        return (f"experts={self.num_experts}, hidden={c.hidden_size}, inter={c.inter_size}, top_k={c.top_k}, "
                f"dtype={c.dtype}, activation={c.activation}, backend={self.backend}")


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
    E, two_inter, hidden = w13.shape
    if two_inter % 2:
        raise ValueError(f"w13's second dimension must be 2*I (gate rows then up rows), got {two_inter}")
    if w2.shape != (E, hidden, two_inter // 2):
        raise ValueError(f"w2 must be [E={E}, H={hidden}, I={two_inter // 2}] to match w13 {list(w13.shape)}, "
                         f"got {list(w2.shape)}")
    if w13.dtype != w2.dtype or w13.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"w13 and w2 must share one dtype of float32/bfloat16/float16, got {w13.dtype}, {w2.dtype}")
    if w13_bias is not None and w13_bias.shape != (E, two_inter):
        raise ValueError(f"w13_bias must be [E={E}, 2I={two_inter}], got {list(w13_bias.shape)}")
    if w2_bias is not None and w2_bias.shape != (E, hidden):
        raise ValueError(f"w2_bias must be [E={E}, H={hidden}], got {list(w2_bias.shape)}")
