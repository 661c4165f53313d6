# Router: turns router logits [M, E] into the experts each token goes to.
#
#   router_logits [M, E] -> scores (softmax | sigmoid, fp32) -> [group mask] -> top-k -> [renormalize] -> * scale
#                        -> topk_weights fp32 [M, k], topk_ids int32 [M, k]
#
# Without expert groups the whole pipeline is one C++ op (ops.route); the grouped modes run in torch
# (select_in_torch, also the op's reference in tests/routing).
#
# Conventions: M tokens, E experts, k = top_k; all maths in float32 whatever the logits' dtype; outputs are
# contiguous; each row is ordered by descending selection score. Exact ties go to the lower expert id in the
# op and as torch.topk (sorted=True) orders them in the torch path.
# Checked against the routers of transformers' Qwen3-MoE, OLMoE, Mixtral, gpt-oss, DeepSeek-V2/V3 and Llama-4
# (tests/routing/test_routing.py).
from collections.abc import Callable

import torch

from cpumoe import ops

SCORINGS = ("softmax", "sigmoid")
_OP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the C++ routing op reads

CustomRouting = Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    custom_routing_function: CustomRouting | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick `top_k` experts per token; returns (topk_weights float32 [M, k], topk_ids int32 [M, k]).

    scoring: "softmax" or "sigmoid", applied to the float32 logits.
      - Qwen3-MoE (norm_topk_prob=True): softmax, renormalize=True.   OLMoE: softmax, renormalize=False.
      - Mixtral and gpt-oss take the top-k logits and softmax over those k: that is the same maths as
        softmax over all E, top-k, renormalize=True (the common factor cancels), so pass renormalize=True.
      - Llama-4: sigmoid, top_k=1, renormalize=False (it sigmoids the top logit: the same, sigmoid is monotonic).
    renormalize: divide the k weights by their sum (+1e-20, as DeepSeek-V3 does).
    num_expert_group, topk_group: grouped top-k (DeepSeek-V2 "group_limited_greedy", DeepSeek-V3): the E experts
      form num_expert_group equal groups; only the topk_group best groups stay selectable. A group's score is
      its best expert's score (V2), or the sum of its best two selection scores when a bias is given (V3).
    e_score_correction_bias [E]: added to the scores for *selection* only (V3's load-balancing bias); the
      returned weights are always the unbiased scores of the chosen experts.
    routed_scaling_factor: multiplies the weights last, in every mode and after renormalization; this is what
      transformers' DeepseekV2/V3 routers do (V2 never renormalizes there; V3 renormalizes, then scales).
      Note DeepSeek's original V2 remote code scaled only when *not* renormalizing: pass 1.0 to get that.
    custom_routing_function(router_logits, top_k, renormalize) -> (weights [M, k], ids [M, k]): replaces
      scoring, grouping and selection; its result is cast to float32 / int32, then scaled.

    Without a bias, experts are selected on the logits themselves (softmax and sigmoid preserve the order),
    so scores that round to 0 or 1 in float32 cannot tie.
    """
    _check_inputs(router_logits, top_k, scoring, num_expert_group, topk_group, e_score_correction_bias)
    if custom_routing_function is not None:
        weights, ids = custom_routing_function(router_logits, top_k, renormalize)
        if weights.shape != (router_logits.shape[0], top_k) or ids.shape != weights.shape:
            raise ValueError(
                f"custom_routing_function must return weights and ids of shape {[router_logits.shape[0], top_k]}, "
                f"got {list(weights.shape)} and {list(ids.shape)}"
            )
        weights = weights.float()
    elif routes_in_one_op(router_logits, num_expert_group):
        # One C++ pass per token (csrc/core/routing.h): at decode this call is a visible share of a layer.
        bias = None if e_score_correction_bias is None else e_score_correction_bias.float().contiguous()
        return ops.route(router_logits, top_k, scoring=scoring, renormalize=renormalize, bias=bias,
                         routed_scaling_factor=routed_scaling_factor)
    else:
        weights, ids = select_in_torch(router_logits, top_k, scoring, renormalize, num_expert_group, topk_group,
                                       e_score_correction_bias)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def routes_in_one_op(router_logits: torch.Tensor, num_expert_group: int | None = None) -> bool:
    """Whether select_experts routes these logits with the C++ routing op (ops.route) rather than torch ops."""
    return num_expert_group is None and router_logits.is_contiguous() and router_logits.dtype in _OP_DTYPES


def select_in_torch(router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool,
                    num_expert_group: int | None, topk_group: int | None,
                    e_score_correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts' maths in torch ops, before scaling (weights float32, ids int64): the grouped modes run
    here, and it is the reference the C++ routing op is tested against."""
    logits = router_logits.float()  # [M, E]
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()  # [M, E]
    choice = logits if e_score_correction_bias is None else scores + e_score_correction_bias.float()  # [M, E]
    if num_expert_group is not None:
        choice = _mask_groups(choice, num_expert_group, topk_group, two_best=e_score_correction_bias is not None)
    ids = torch.topk(choice, top_k, dim=-1, sorted=True).indices  # [M, k]
    weights = scores.gather(1, ids)  # [M, k]
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights, ids


def _mask_groups(choice: torch.Tensor, num_groups: int, topk_group: int, two_best: bool) -> torch.Tensor:
    """Set the selection scores of all but the `topk_group` best groups to -inf."""
    M, E = choice.shape
    grouped = choice.view(M, num_groups, E // num_groups)  # [M, G, E/G]
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1) if two_best else grouped.amax(dim=-1)  # [M, G]
    keep_groups = torch.topk(group_scores, topk_group, dim=-1, sorted=True).indices  # [M, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)  # [M, G]
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(M, E)


def _check_inputs(router_logits, top_k, scoring, num_expert_group, topk_group, bias) -> None:
    if not isinstance(router_logits, torch.Tensor) or not router_logits.is_floating_point():
        got = getattr(router_logits, "dtype", type(router_logits).__name__)
        raise ValueError(f"router_logits must be a floating-point tensor, got {got}")
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be 2-D [M, E], got shape {list(router_logits.shape)}")
    E = router_logits.shape[1]
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, E={E}], got {top_k}")
    if scoring not in SCORINGS:
        raise ValueError(f"unknown scoring {scoring!r}, expected one of {SCORINGS}")
    if bias is not None and tuple(bias.shape) != (E,):
        raise ValueError(f"e_score_correction_bias must have shape [E={E}], got {list(bias.shape)}")
    if num_expert_group is None:
        if topk_group is not None:
            raise ValueError("topk_group given without num_expert_group")
        return
    if num_expert_group < 1 or E % num_expert_group:
        raise ValueError(f"num_expert_group={num_expert_group} must be >= 1 and divide the E={E} experts")
    if topk_group is None or not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group must be given and in [1, num_expert_group={num_expert_group}], got {topk_group}")
    group_size = E // num_expert_group
    if top_k > topk_group * group_size:
        raise ValueError(
            f"top_k={top_k} is larger than the {topk_group * group_size} experts in the {topk_group} kept groups"
        )
    if bias is not None and group_size < 2:
        raise ValueError(
            "grouped top-k with e_score_correction_bias scores groups by their best two experts, "
            f"so it needs at least 2 experts per group, got {group_size}"
        )
