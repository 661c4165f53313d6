"""Every kernel backend this machine can run, against cpumoe.reference, over shape/dtype/activation grids."""
import threading
import time

import pytest
import torch

import cpumoe
from cpumoe import ops, reference
from tests.kernels.moe_cases import MoECase, assert_fake_matches, backend_dtype_grid, make_problem
from tests.kernels.tolerances import assert_moe_close

SHAPES = [
    MoECase(M=1, H=64, I=32, E=1, k=1),
    MoECase(M=2, H=128, I=64, E=8, k=2),
    MoECase(M=7, H=130, I=70, E=8, k=2),      # H, I not multiples of 32
    MoECase(M=33, H=96, I=40, E=8, k=8),      # every expert active
    MoECase(M=128, H=200, I=96, E=64, k=8),
    MoECase(M=1000, H=64, I=48, E=128, k=8),
    MoECase(M=5, H=63, I=17, E=3, k=1),       # odd hidden size: pairs/quads layouts pad K
    MoECase(M=39, H=2048, I=768, E=8, k=2),   # real qwen3 per-expert shapes
    MoECase(M=150, H=200, I=72, E=4, k=2),    # ~75 scattered rows an expert: whole tiles of 32 and 16 rows and a
                                              # rest, K past its last whole 32 (x86-amx's paths)
    MoECase(M=512, H=520, I=64, E=16, k=8),   # w2 outputs past 8 MB: written past the caches, a narrow last block
]
ACTIVATIONS = ["silu", "gelu", "gelu_tanh", "swigluoai"]


def run(backend: str, p, *, activation="silu", expert_map=None, num_experts=None, on_input=False):
    layer = cpumoe.FusedMoE(p.w13, p.w2, top_k=p.topk_ids.shape[1], activation=activation, w13_bias=p.w13_bias,
                            w2_bias=p.w2_bias, expert_map=expert_map, num_experts=num_experts,
                            apply_router_weight_on_input=on_input, backend=backend)
    assert layer.backend == backend
    return layer.experts(p.x, p.topk_weights, p.topk_ids)


def check(backend, dtype, p, msg, **kw):
    ref_kw = {k: v for k, v in kw.items() if k not in ("num_experts", "on_input")}
    ref = reference.fused_experts(p.x, p.w13, p.w2, p.topk_weights, p.topk_ids, w13_bias=p.w13_bias,
                                  w2_bias=p.w2_bias, apply_router_weight_on_input=kw.get("on_input", False), **ref_kw)
    assert_moe_close(run(backend, p, **kw), ref, dtype, msg)


@pytest.mark.parametrize("backend,dtype", backend_dtype_grid())
@pytest.mark.parametrize("case", SHAPES, ids=lambda c: c.id)
def test_shapes(backend, dtype, case):
    check(backend, dtype, make_problem(case, dtype), f"{backend} {dtype} {case.id}")


@pytest.mark.parametrize("backend,dtype", backend_dtype_grid())
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_activations_and_bias(backend, dtype, activation, bias):
    case = MoECase(M=17, H=96, I=70, E=8, k=2)
    check(backend, dtype, make_problem(case, dtype, bias=bias), f"{backend} {activation} bias={bias}",
          activation=activation)


@pytest.mark.parametrize("backend,dtype", backend_dtype_grid())
def test_expert_map_with_missing_experts(backend, dtype):
    # 8 global experts, this shard holds 3 of them (global 1, 4, 6 -> local 0, 1, 2).
    case = MoECase(M=29, H=64, I=48, E=8, k=2)
    full = make_problem(case, dtype)
    expert_map = torch.full((8,), -1, dtype=torch.int32)
    expert_map[torch.tensor([1, 4, 6])] = torch.arange(3, dtype=torch.int32)
    local = make_problem(case, dtype)
    local.w13, local.w2 = full.w13[[1, 4, 6]].contiguous(), full.w2[[1, 4, 6]].contiguous()
    check(backend, dtype, local, f"{backend} expert_map", expert_map=expert_map, num_experts=8)


@pytest.mark.parametrize("backend,dtype", backend_dtype_grid())
def test_all_tokens_to_one_expert(backend, dtype):
    case = MoECase(M=300, H=64, I=40, E=16, k=1)
    check(backend, dtype, make_problem(case, dtype, topk_ids=torch.full((300, 1), 5)), f"{backend} skewed")


@pytest.mark.parametrize("backend,dtype", backend_dtype_grid())
def test_router_weight_on_input(backend, dtype):
    case = MoECase(M=9, H=64, I=40, E=4, k=1)
    check(backend, dtype, make_problem(case, dtype), f"{backend} weight on input", on_input=True)


@pytest.mark.parametrize("backend,dtype", [p for p in backend_dtype_grid() if p.values[0] != "naive"])
def test_one_and_two_threads_agree_exactly(backend, dtype):
    # Native backends only: naive uses torch's GEMMs, whose blocking (so rounding) depends on the thread count.
    p = make_problem(MoECase(M=65, H=128, I=96, E=16, k=4), dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(backend, p)
        torch.set_num_threads(2)
        two = run(backend, p)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two), f"{backend}: results differ between 1 and 2 threads"


def test_forward_routes_like_select_experts():
    case = MoECase(M=11, H=64, I=32, E=8, k=2)
    p = make_problem(case, torch.float32)
    logits = torch.randn(case.M, case.E)
    layer = cpumoe.FusedMoE(p.w13, p.w2, top_k=2, renormalize=False)
    weights, ids = cpumoe.select_experts(logits, 2, renormalize=False)
    ref = reference.fused_experts(p.x, p.w13, p.w2, weights, ids)
    assert_moe_close(layer(p.x, logits), ref, torch.float32, "forward")


def test_ops_trace_under_compile():
    p = make_problem(MoECase(M=4, H=64, I=32, E=4, k=2), torch.bfloat16)
    layer = cpumoe.FusedMoE(p.w13, p.w2, top_k=2)
    if layer.backend == "naive":
        pytest.skip("no native backend on this CPU")
    args = (p.x, layer.prepared.w13, layer.prepared.w2, p.topk_weights, p.topk_ids)
    kwargs = dict(backend=layer.backend, activation="silu")
    assert_fake_matches(torch.ops.cpumoe.fused_experts.default, args, kwargs)
    torch.library.opcheck(torch.ops.cpumoe.pack_w13.default, (p.w13, layer.backend), test_utils=("test_faketensor",))
    compiled = torch.compile(lambda x, w, i: ops.fused_experts(x, args[1], args[2], w, i, **kwargs), fullgraph=True)
    torch.testing.assert_close(compiled(p.x, p.topk_weights, p.topk_ids), layer.experts(p.x, p.topk_weights, p.topk_ids))


@pytest.mark.parametrize("backend,dtype", backend_dtype_grid())
def test_empty_batch(backend, dtype):
    p = make_problem(MoECase(M=3, H=64, I=32, E=4, k=2), dtype)
    layer = cpumoe.FusedMoE(p.w13, p.w2, top_k=2, backend=backend)
    out = layer(p.x[:0], torch.zeros(0, 4))
    assert out.shape == (0, 64) and out.dtype == dtype


@pytest.mark.parametrize("backend,dtype", backend_dtype_grid())
def test_expert_reader_packs_like_whole_tensors(backend, dtype):
    p = make_problem(MoECase(M=21, H=96, I=40, E=6, k=2), dtype, bias=True)
    whole = cpumoe.FusedMoE(p.w13, p.w2, top_k=2, w13_bias=p.w13_bias, w2_bias=p.w2_bias, backend=backend)
    read = []
    streamed = cpumoe.FusedMoE(p.w13.to("meta"), p.w2.to("meta"), top_k=2, w13_bias=p.w13_bias, w2_bias=p.w2_bias,
                               backend=backend, expert_reader=lambda e: read.append(e) or (p.w13[e], p.w2[e]))
    assert sorted(read) == list(range(6))
    assert torch.equal(streamed.experts(p.x, p.topk_weights, p.topk_ids), whole.experts(p.x, p.topk_weights, p.topk_ids))


def test_expert_reader_shape_mismatch_is_named():
    p = make_problem(MoECase(M=2, H=64, I=32, E=2, k=1), torch.float32)
    with pytest.raises(ValueError, match="expert 0: w13"):
        cpumoe.FusedMoE(p.w13.to("meta"), p.w2.to("meta"), top_k=1, expert_reader=lambda e: (p.w13[e][:10], p.w2[e]))


@pytest.mark.parametrize("backend,dtype", [p for p in backend_dtype_grid() if p.values[0] != "naive"])
def test_batch_invariant_layer_gives_a_row_the_same_bits_alone_and_in_a_batch(backend, dtype):
    """After make_batch_invariant a token's output does not depend on the other tokens of the call: x86-amx (AMX
    tiles from 4 rows, AVX-512 ones below) hands the layer to a backend that packs alike; the others stay."""
    p = make_problem(MoECase(M=40, H=128, I=96, E=2, k=1), dtype)
    layer = cpumoe.FusedMoE(p.w13, p.w2, top_k=1, backend=backend)
    layer.make_batch_invariant()
    assert (layer.backend != "x86-amx") and (backend == "x86-amx" or layer.backend == backend)
    batch = layer.experts(p.x, p.topk_weights, p.topk_ids)
    alone = layer.experts(p.x[:1], p.topk_weights[:1], p.topk_ids[:1])
    assert torch.equal(alone[0], batch[0])


def test_kernel_clock_counts_the_calling_threads_calls():
    p = make_problem(MoECase(M=4, H=64, I=32, E=4, k=2), torch.bfloat16)
    layer = cpumoe.FusedMoE(p.w13, p.w2, top_k=2)
    calls, _ = ops.experts_kernel_clock()
    start = time.perf_counter()
    layer.experts(p.x, p.topk_weights, p.topk_ids)
    wall = time.perf_counter() - start
    after, seconds = ops.experts_kernel_clock()
    assert after == calls + 1 and 0 < seconds <= wall
    other = threading.Thread(target=lambda: layer.experts(p.x, p.topk_weights, p.topk_ids))
    other.start()
    other.join()
    with pytest.raises(ValueError, match="expert id"):
        layer.experts(p.x, p.topk_weights, torch.full_like(p.topk_ids, 9))
    assert ops.experts_kernel_clock() == (after, seconds)   # another thread's call, and one that raised
