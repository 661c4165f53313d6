# Checks cpumoe.routing.select_experts against the routers of transformers' MoE models (tiny configs, random
# weights, logits = hidden @ gate.weight.T (+ bias)), plus its input validation and custom routing functions.
# Seeds are fixed and logits have std ~2, so the k-th and (k+1)-th experts are never near a tie.
import pytest
import torch
from torch.testing import assert_close
from transformers import (
    DeepseekV2Config, DeepseekV3Config, GptOssConfig, Llama4TextConfig, MixtralConfig, OlmoeConfig, Qwen3MoeConfig,
)
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.llama4.modeling_llama4 import Llama4Router
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from cpumoe.routing import select_experts

H = 32  # hidden size
TOL = dict(rtol=1e-5, atol=1e-5)


def _random(router: torch.nn.Module) -> torch.nn.Module:
    """Random gate weights (logit std ~2) and biases (gpt-oss router bias, DeepSeek-V3 correction bias)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, t in [*router.named_parameters(), *router.named_buffers()]:
            t.copy_(torch.randn_like(t) * (0.3 if "bias" in name else 2 / H**0.5))
    return router.eval()


def _deepseek_v3():
    cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=32, num_experts_per_tok=4, n_group=8, topk_group=3,
                           norm_topk_prob=True, routed_scaling_factor=2.5)
    router = _random(DeepseekV3TopkRouter(cfg))
    return router, dict(top_k=4, scoring="sigmoid", renormalize=True, num_expert_group=8, topk_group=3,
                        e_score_correction_bias=router.e_score_correction_bias, routed_scaling_factor=2.5)


# name -> () -> (transformers router with random weights, select_experts arguments that should match it)
CASES = {
    "qwen3_moe-softmax-renorm": lambda: (_random(Qwen3MoeTopKRouter(Qwen3MoeConfig(
        hidden_size=H, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True))), dict(top_k=4, renormalize=True)),
    "olmoe-softmax": lambda: (_random(OlmoeTopKRouter(OlmoeConfig(
        hidden_size=H, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False))), dict(top_k=4)),
    "mixtral-topk-then-softmax": lambda: (_random(MixtralTopKRouter(MixtralConfig(
        hidden_size=H, num_local_experts=8, num_experts_per_tok=2))), dict(top_k=2, renormalize=True)),
    "gpt_oss-topk-then-softmax-bias": lambda: (_random(GptOssTopKRouter(GptOssConfig(
        hidden_size=H, num_local_experts=16, num_experts_per_tok=4))), dict(top_k=4, renormalize=True)),
    "deepseek_v2-softmax-group_max-scaled": lambda: (_random(DeepseekV2TopkRouter(DeepseekV2Config(
        hidden_size=H, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", routed_scaling_factor=1.5))),
        dict(top_k=3, num_expert_group=4, topk_group=2, routed_scaling_factor=1.5)),
    "deepseek_v3-sigmoid-group_top2-bias-renorm": _deepseek_v3,
    "llama4-sigmoid-top1": lambda: (_random(Llama4Router(Llama4TextConfig(
        hidden_size=H, num_local_experts=16, num_experts_per_tok=1))), dict(top_k=1, scoring="sigmoid")),
}


@pytest.mark.parametrize("M", [1, 7, 33], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("name", CASES)
def test_matches_transformers(name, M):
    router, kwargs = CASES[name]()
    torch.manual_seed(M)
    hidden = torch.randn(M, H)
    bias = getattr(router, "bias", None)
    logits = hidden @ router.weight.T + (0 if bias is None else bias)  # [M, E]
    weights, ids = select_experts(logits, **kwargs)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32, f"{name}: {weights.dtype}, {ids.dtype}"
    assert weights.is_contiguous() and ids.is_contiguous() and ids.shape == (M, kwargs["top_k"]), name
    with torch.no_grad():
        out = router(hidden)
    if isinstance(router, Llama4Router):  # dense [M, E] scores, 0 where not chosen
        dense = torch.zeros_like(logits).scatter_(1, ids.long(), weights)
        assert_close(dense, out[0], **TOL, msg=f"{name} M={M}: dense routing weights differ")
        return
    ref_weights, ref_ids = out[1], out[2]  # (logits, weights [M, k], ids [M, k])
    ref_ids, order = ref_ids.sort(dim=-1)
    ids_sorted, our_order = ids.long().sort(dim=-1)
    assert torch.equal(ids_sorted, ref_ids), f"{name} M={M}: experts differ\n{ids_sorted}\n{ref_ids}"
    assert_close(weights.gather(1, our_order), ref_weights.float().gather(1, order), **TOL,
                 msg=f"{name} M={M}: weights differ")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_logits_computed_in_fp32(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(9, 16) * 2).to(dtype)
    kwargs = dict(top_k=3, scoring="sigmoid", renormalize=True, num_expert_group=4, topk_group=2)
    weights, ids = select_experts(logits, **kwargs)
    ref_weights, ref_ids = select_experts(logits.float(), **kwargs)
    assert weights.dtype == torch.float32 and torch.equal(ids, ref_ids), dtype
    assert_close(weights, ref_weights, rtol=0, atol=0, msg=f"{dtype}: weights differ from the fp32 path")


def test_custom_routing_function():
    torch.manual_seed(0)
    logits = torch.randn(5, 8) * 2
    calls = []

    def lowest(router_logits, top_k, renormalize):  # picks the k lowest logits, equal weights, float64/int64
        calls.append((router_logits, top_k, renormalize))
        ids = router_logits.topk(top_k, largest=False).indices
        return torch.full(ids.shape, 1 / top_k, dtype=torch.float64), ids

    weights, ids = select_experts(logits, 2, renormalize=True, routed_scaling_factor=3.0,
                                  custom_routing_function=lowest)
    assert len(calls) == 1 and calls[0][0] is logits and calls[0][1:] == (2, True), calls
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, logits.topk(2, largest=False).indices.int()), ids
    assert_close(weights, torch.full((5, 2), 1.5), msg="custom weights are scaled by routed_scaling_factor")


def _bad_custom(router_logits, top_k, renormalize):
    return torch.ones(router_logits.shape[0], top_k + 1), torch.zeros(router_logits.shape[0], top_k + 1)


LOGITS = torch.randn(3, 8)
BAD_INPUTS = {
    "int-logits": (torch.ones(3, 8, dtype=torch.int64), dict(top_k=2), "floating-point"),
    "1d-logits": (torch.randn(8), dict(top_k=2), "must be 2-D"),
    "top_k-0": (LOGITS, dict(top_k=0), r"top_k must be in \[1, E=8\]"),
    "top_k-above-E": (LOGITS, dict(top_k=9), r"top_k must be in \[1, E=8\]"),
    "unknown-scoring": (LOGITS, dict(top_k=2, scoring="relu"), "unknown scoring 'relu'"),
    "groups-not-dividing-E": (LOGITS, dict(top_k=2, num_expert_group=3, topk_group=1), "divide the E=8"),
    "topk_group-missing": (LOGITS, dict(top_k=2, num_expert_group=4), "topk_group must be given"),
    "topk_group-above-groups": (LOGITS, dict(top_k=2, num_expert_group=4, topk_group=5), "topk_group must be"),
    "topk_group-without-groups": (LOGITS, dict(top_k=2, topk_group=2), "without num_expert_group"),
    "top_k-above-kept-experts": (LOGITS, dict(top_k=3, num_expert_group=4, topk_group=1),
                                 "larger than the 2 experts in the 1 kept groups"),
    "bias-shape": (LOGITS, dict(top_k=2, e_score_correction_bias=torch.zeros(7)), "must have shape"),
    "bias-with-1-expert-groups": (LOGITS, dict(top_k=2, num_expert_group=8, topk_group=2,
                                               e_score_correction_bias=torch.zeros(8)), "at least 2 experts per group"),
    "custom-wrong-shape": (LOGITS, dict(top_k=2, custom_routing_function=_bad_custom), "must return weights and ids"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_raises(name):
    logits, kwargs, match = BAD_INPUTS[name]
    with pytest.raises(ValueError, match=match):
        select_experts(logits, **kwargs)
