"""Bad input raises ValueError/RuntimeError naming the problem; it never crashes the process."""
import pytest
import torch

import cpumoe
from cpumoe import ops
from cpumoe.experts import ExpertsConfig, NoSupportedBackend, choose_backend
from tests.kernels.moe_cases import MoECase, make_problem, runnable_backends

NATIVE_BF16 = [p for p in runnable_backends(torch.bfloat16) if p != "naive"]


@pytest.fixture(scope="module")
def problem():
    return make_problem(MoECase(M=4, H=64, I=32, E=4, k=2), torch.bfloat16)


@pytest.fixture(scope="module", params=NATIVE_BF16)
def packed(request, problem):
    layer = cpumoe.FusedMoE(problem.w13, problem.w2, top_k=2, backend=request.param)
    return request.param, layer.prepared


def call(packed, problem, **over):
    backend, prep = packed
    args = dict(hidden_states=problem.x, w13=prep.w13, w2=prep.w2, topk_weights=problem.topk_weights,
                topk_ids=problem.topk_ids, backend=backend, activation="silu")
    args.update(over)
    return ops.fused_experts(**args)


OP_CASES = {
    "hidden-1d": (dict(hidden_states=torch.zeros(64, dtype=torch.bfloat16)), "hidden_states must be 2-D"),
    "hidden-noncontiguous": (dict(hidden_states=torch.zeros(64, 4, dtype=torch.bfloat16).T), "must be contiguous"),
    "hidden-wrong-size": (dict(hidden_states=torch.zeros(4, 70, dtype=torch.bfloat16)),
                          "width 70 but the experts were packed for hidden size 64"),
    # 63 pads to the same blocks as 64 on every layout: only the packing's record tells them apart.
    "hidden-63-against-64": (dict(hidden_states=torch.zeros(4, 63, dtype=torch.bfloat16)),
                             "width 63 but the experts were packed for hidden size 64"),
    "hidden-int": (dict(hidden_states=torch.zeros(4, 64, dtype=torch.int32)), "must be float32, bfloat16 or float16"),
    "ids-out-of-range": (dict(topk_ids=torch.tensor([[0, 4]] * 4, dtype=torch.int32)), r"expert id 4 .*outside \[0, 4\)"),
    "ids-negative": (dict(topk_ids=torch.tensor([[0, -3]] * 4, dtype=torch.int32)), "expert id -3"),
    "ids-int64": (dict(topk_ids=torch.zeros(4, 2, dtype=torch.int64)), "topk_ids must be int32"),
    "weights-fp16": (dict(topk_weights=torch.zeros(4, 2, dtype=torch.float16)), "topk_weights must be float32"),
    "ids-wrong-rows": (dict(topk_ids=torch.zeros(3, 2, dtype=torch.int32)), "must both be"),
    "unknown-activation": (dict(activation="relu2"), "unknown activation 'relu2'"),
    "unknown-backend": (dict(backend="riscv-rvv"), "unknown kernel backend 'riscv-rvv'"),
    "on-input-needs-k1": (dict(apply_router_weight_on_input=True), "needs top_k == 1"),
    "expert-map-out-of-range": (dict(expert_map=torch.tensor([0, 1, 2, 9], dtype=torch.int32)), "maps expert 3 to local id 9"),
    "bias-wrong-shape": (dict(w13_bias=torch.zeros(4, 10)), "packed w13_bias must be float32"),
}


@pytest.mark.parametrize("case", OP_CASES.values(), ids=OP_CASES.keys())
def test_op_rejects(packed, problem, case):
    over, message = case
    with pytest.raises((ValueError, RuntimeError), match=message):
        call(packed, problem, **over)


LAYOUT = {name: layout for name, _, layout, *_ in ops._C.kernel_backends()}


@pytest.mark.parametrize("packed_for", NATIVE_BF16)
def test_op_takes_only_weights_packed_in_its_layout(problem, packed_for):
    """A packing runs on every backend of its layout and is refused by the others, even where the two packings have
    the same tensor shape."""
    prep = cpumoe.FusedMoE(problem.w13, problem.w2, top_k=2, backend=packed_for).prepared
    expected = call((packed_for, prep), problem)
    for other in NATIVE_BF16:
        if LAYOUT[other] == LAYOUT[packed_for]:
            torch.testing.assert_close(call((other, prep), problem), expected, rtol=0.02, atol=0.02)
        else:
            with pytest.raises(ValueError, match=f"packed as backend '{packed_for}'.*this call runs backend '{other}'"):
                call((other, prep), problem)


def test_op_rejects_swapped_copied_and_foreign_weights(packed, problem):
    backend, prep = packed
    with pytest.raises(ValueError, match="swapped or mixed"):
        call(packed, problem, w13=prep.w2, w2=prep.w13)
    with pytest.raises(ValueError, match="packed w13 is not a weight packed by cpumoe"):
        call(packed, problem, w13=prep.w13.clone())
    with pytest.raises(ValueError, match="packed w2 is not a weight packed by cpumoe"):
        call(packed, problem, w2=torch.zeros_like(prep.w2))
    other = cpumoe.FusedMoE(problem.w13[:, :32].contiguous(), problem.w2[:, :, :16].contiguous(), top_k=2,
                            backend=backend).prepared  # intermediate 16
    with pytest.raises(ValueError, match="do not share an intermediate size"):
        call(packed, problem, w2=other.w2)


def test_op_rejects_weights_of_other_dtype(packed, problem):
    backend, prep = packed
    with pytest.raises(RuntimeError, match="must have the dtype of hidden_states"):
        call(packed, problem, w13=prep.w13.half())


def test_pack_rejects_dtype_the_backend_cannot_take():
    if "x86-avx512bf16" not in NATIVE_BF16:
        pytest.skip("x86-avx512bf16 not available")
    with pytest.raises(RuntimeError, match="does not take float32 weights"):
        ops.pack_w13(torch.zeros(2, 8, 16), "x86-avx512bf16")


LAYER_CASES = {
    "w13-2d": (lambda p: dict(w13=p.w13[0]), "w13 must be"),
    "w2-mismatch": (lambda p: dict(w2=p.w2[:, :, :5]), "w2 must be"),
    "odd-2I": (lambda p: dict(w13=p.w13[:, :63]), "2\\*I"),
    "int-weights": (lambda p: dict(w13=p.w13.int(), w2=p.w2.int()), "share one dtype"),
    "bias-shape": (lambda p: dict(w13_bias=torch.zeros(4, 5)), "w13_bias must be"),
    "expert-map-shape": (lambda p: dict(expert_map=torch.zeros(3, dtype=torch.int32), num_experts=8), "expert_map must have shape"),
    "num-experts-without-map": (lambda p: dict(num_experts=8), "no expert_map"),
    "unknown-backend": (lambda p: dict(backend="tpu"), "unknown backend 'tpu'"),
}


@pytest.mark.parametrize("case", LAYER_CASES.values(), ids=LAYER_CASES.keys())
def test_layer_rejects(problem, case):
    make_over, message = case
    kw = dict(w13=problem.w13, w2=problem.w2, top_k=2)
    kw.update(make_over(problem))
    with pytest.raises(ValueError, match=message):
        cpumoe.FusedMoE(kw.pop("w13"), kw.pop("w2"), **kw)


def test_forward_rejects_bad_shapes(problem):
    layer = cpumoe.FusedMoE(problem.w13, problem.w2, top_k=2)
    with pytest.raises(ValueError, match="hidden_states must be"):
        layer(problem.x[:, :10], torch.zeros(4, 4))
    with pytest.raises(ValueError, match="dtype"):
        layer(problem.x.float(), torch.zeros(4, 4))
    with pytest.raises(ValueError, match="router_logits must be"):
        layer(problem.x, torch.zeros(4, 5))


def test_forced_backend_says_why(problem):
    if "x86-avx512bf16" not in NATIVE_BF16:
        pytest.skip("x86-avx512bf16 not available")
    with pytest.raises(NoSupportedBackend, match="takes bfloat16 only"):
        cpumoe.FusedMoE(problem.w13.float(), problem.w2.float(), top_k=2, backend="x86-avx512bf16")


def test_no_backend_lists_every_candidate():
    config = ExpertsConfig(hidden_size=64, inter_size=32, num_experts=4, top_k=2, dtype=torch.bfloat16,
                           activation="relu")
    with pytest.raises(NoSupportedBackend) as err:
        choose_backend(config)
    for name in ("x86-avx512bf16", "x86-avx2", "arm-neon", "generic", "naive"):
        assert name in str(err.value)
    assert "no activation 'relu'" in str(err.value)
