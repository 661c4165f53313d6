# The C++ routing op (csrc/core/routing.h) against select_in_torch, the same maths in torch ops, over a grid
# of scorings, biases, renormalization, scaling, dtypes and shapes; plus the ties, NaN and -inf rows where an
# ordering rule, not arithmetic, decides. Weights agree to float32 rounding (exp and the sums are computed
# in another order); ids must be equal.
import pytest
import torch
from torch.testing import assert_close

from cpumoe import ops
from cpumoe.routing import select_experts, select_in_torch

TOL = dict(rtol=2e-6, atol=1e-7)


def reference(logits, top_k, scoring, renormalize, bias, scale):
    weights, ids = select_in_torch(logits, top_k, scoring, renormalize, None, None, bias)
    return weights * scale, ids.int()


@pytest.mark.parametrize("M,E,k", [(1, 128, 8), (7, 60, 4), (33, 8, 2), (5, 16, 1), (3, 4, 4)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_torch(M, E, k, scoring, renormalize, with_bias, dtype):
    g = torch.Generator().manual_seed(M * 1000 + E)
    logits = (torch.randn(M, E, generator=g) * 2).to(dtype)
    bias = torch.randn(E, generator=g) * 0.1 if with_bias else None
    scale = 2.5 if with_bias else 1.0
    weights, ids = ops.route(logits, k, scoring=scoring, renormalize=renormalize, bias=bias,
                             routed_scaling_factor=scale)
    ref_weights, ref_ids = reference(logits, k, scoring, renormalize, bias, scale)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == (M, k)
    assert torch.equal(ids, ref_ids), (ids, ref_ids)
    assert_close(weights, ref_weights, **TOL)


def test_select_experts_uses_the_op_and_keeps_groups_in_torch():
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    weights, ids = select_experts(logits, 2, renormalize=True)
    ref_weights, ref_ids = reference(logits, 2, "softmax", True, None, 1.0)
    assert torch.equal(ids, ref_ids)
    assert_close(weights, ref_weights, **TOL)
    # grouped top-k and non-contiguous logits take the torch path and still agree with its maths
    weights, ids = select_experts(logits, 2, num_expert_group=4, topk_group=2, renormalize=True)
    assert ids.dtype == torch.int32 and weights.shape == (4, 2)
    weights, ids = select_experts(logits.t().contiguous().t(), 2, renormalize=True)
    assert torch.equal(ids, ref_ids)


def test_ties_go_to_the_lower_expert_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0], [0.0] * 6])
    _, ids = ops.route(logits, 3, scoring="softmax", renormalize=True)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]


def test_nan_and_masked_rows_fill_every_slot():
    logits = torch.tensor([[float("-inf")] * 5, [0.0, float("nan"), 1.0, float("-inf"), 2.0]])
    weights, ids = ops.route(logits, 2, scoring="sigmoid", renormalize=False)
    assert ids[0].tolist() == [0, 1]  # all masked: the first k, still valid ids
    assert ids[1].tolist() == [1, 4]  # NaN sorts first, as torch.topk puts it
    assert weights[0].tolist() == [0.0, 0.0] and torch.isnan(weights[1, 0])


@pytest.mark.parametrize("call, match", [
    (lambda: ops.route(torch.randn(2, 8), 9, scoring="softmax", renormalize=True), "top_k must be in"),
    (lambda: ops.route(torch.randn(2, 8), 2, scoring="relu", renormalize=True), "unknown scoring"),
    (lambda: ops.route(torch.randn(2, 8), 2, scoring="softmax", renormalize=True, bias=torch.zeros(7)),
     "e_score_correction_bias"),
    (lambda: ops.route(torch.randn(8), 2, scoring="softmax", renormalize=True), "router_logits"),
    (lambda: ops.route(torch.randn(2, 8, dtype=torch.float64), 2, scoring="softmax", renormalize=True),
     "router_logits"),
], ids=["k", "scoring", "bias", "rank", "dtype"])
def test_bad_input_names_the_problem(call, match):
    with pytest.raises((ValueError, RuntimeError), match=match):
        call()


def test_fake_kernel_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        weights, ids = ops.route(torch.empty(5, 64), 4, scoring="softmax", renormalize=True)
    assert weights.shape == ids.shape == (5, 4) and ids.dtype == torch.int32
