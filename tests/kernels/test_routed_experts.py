"""FusedMoE.forward's one-call path (the RoutedExperts binding: routing and experts in one native call, eagerly)
against select_experts then FusedMoE.experts (the two ops it replaces): the same bits for every native backend,
float dtype, quantized format and routing mode the C++ routing op takes; the two ops where it does not apply."""
import pytest
import torch

import cpumoe
from cpumoe import ops
from tests.kernels.moe_cases import MoECase, make_problem, runnable_backends
from tests.kernels.test_quant_fused_moe import native_backends_for

CASE = MoECase(M=9, H=128, I=64, E=8, k=2)
ROUTINGS = {
    "softmax-renormalize": dict(),
    "sigmoid-bias-scaled": dict(scoring="sigmoid", renormalize=False, routed_scaling_factor=2.5),
    "softmax-plain": dict(renormalize=False),
}


def layers() -> list:
    out = []
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for backend in runnable_backends(dtype):
            if backend != "naive":
                out.append(pytest.param(backend, dtype, None, id=f"{backend}-{str(dtype).removeprefix('torch.')}"))
    for fmt in ("int8_w8a8", "int4_w4a16", "fp8_w8a16", "mxfp4_w4a16"):
        for backend in native_backends_for(fmt, torch.bfloat16):
            out.append(pytest.param(backend, torch.bfloat16, fmt, id=f"{backend}-{fmt}"))
    return out


@pytest.fixture
def one_calls(monkeypatch):
    """How many times the one-call path (a RoutedExperts binding) ran a layer (gave an output, not None)."""
    calls = []
    real = ops._C.RoutedExperts

    class Counted:
        def __init__(self, *args):
            self.bound = real(*args)

        def __call__(self, hidden_states, router_logits):
            out = self.bound(hidden_states, router_logits)
            if out is not None:
                calls.append(1)
            return out

    monkeypatch.setattr(ops._C, "RoutedExperts", Counted)
    return calls


def two_ops(layer, x, logits):
    weights, ids = cpumoe.select_experts(logits, layer.top_k, **layer.routing)
    return layer.experts(x, weights, ids)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("backend,dtype,fmt", layers())
def test_one_call_gives_the_bits_of_the_two_ops(backend, dtype, fmt, routing, one_calls):
    p = make_problem(CASE, dtype, bias=fmt is None, seed=3)
    kw = dict(ROUTINGS[routing])
    if routing == "sigmoid-bias-scaled":
        kw["e_score_correction_bias"] = torch.randn(CASE.E, generator=torch.Generator().manual_seed(1))
    layer = cpumoe.FusedMoE(p.w13, p.w2, top_k=CASE.k, w13_bias=p.w13_bias, w2_bias=p.w2_bias, backend=backend,
                            quant=fmt, **kw)
    logits = torch.randn(CASE.M, CASE.E, generator=torch.Generator().manual_seed(2))
    for rows in (CASE.M, 1, 0):
        out = layer(p.x[:rows], logits[:rows])
        assert torch.equal(out, two_ops(layer, p.x[:rows], logits[:rows])), (backend, fmt, routing, rows)
    assert len(one_calls) == 3


@pytest.mark.parametrize("backend", [b for b in runnable_backends(torch.bfloat16) if b != "naive"])
def test_expert_map_and_router_weight_on_input(backend, one_calls):
    p = make_problem(MoECase(M=6, H=64, I=32, E=6, k=1), torch.bfloat16, seed=5)
    expert_map = torch.tensor([-1, 0, 1, -1, 2, 3, 4, 5], dtype=torch.int32)  # 8 global experts, 6 here
    layer = cpumoe.FusedMoE(p.w13, p.w2, top_k=1, expert_map=expert_map, num_experts=8, backend=backend,
                            apply_router_weight_on_input=True)
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(4))
    assert torch.equal(layer(p.x, logits), two_ops(layer, p.x, logits))
    assert len(one_calls) == 1


def test_routing_the_op_does_not_take_runs_the_two_ops(one_calls):
    p = make_problem(MoECase(M=5, H=64, I=32, E=8, k=2), torch.float32, seed=6)
    grouped = cpumoe.FusedMoE(p.w13, p.w2, top_k=2, num_expert_group=4, topk_group=2)
    plain = cpumoe.FusedMoE(p.w13, p.w2, top_k=2)
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(7))
    assert torch.equal(grouped(p.x, logits), two_ops(grouped, p.x, logits))
    wide = torch.randn(8, 5, generator=torch.Generator().manual_seed(8)).t()  # not contiguous
    assert torch.equal(plain(p.x, wide), two_ops(plain, p.x, wide))
    assert one_calls == []


def test_naive_backend_runs_the_two_ops(one_calls):
    p = make_problem(MoECase(M=3, H=64, I=32, E=4, k=2), torch.float32, seed=9)
    layer = cpumoe.FusedMoE(p.w13, p.w2, top_k=2, backend="naive")
    logits = torch.randn(3, 4)
    assert torch.equal(layer(p.x, logits), two_ops(layer, p.x, logits))
    assert one_calls == [] and layer._routed is None


def test_compiled_forward_runs_the_ops(one_calls):
    p = make_problem(MoECase(M=4, H=64, I=32, E=4, k=2), torch.bfloat16, seed=10)
    layer = cpumoe.FusedMoE(p.w13, p.w2, top_k=2)
    logits = torch.randn(4, 4)
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(p.x, logits), two_ops(layer, p.x, logits))
    assert one_calls == []


@pytest.mark.parametrize("backend", ["naive", *[b for b in runnable_backends(torch.float32) if b != "naive"][:1]])
def test_bad_routing_input_is_named(backend):
    p = make_problem(MoECase(M=2, H=64, I=32, E=4, k=2), torch.float32, seed=11)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        cpumoe.FusedMoE(p.w13, p.w2, top_k=2, scoring="sigmoid", backend=backend,
                        e_score_correction_bias=torch.zeros(3))  # E is 4


def test_tensors_the_binding_was_not_made_for_take_the_checked_ops(one_calls):
    p = make_problem(MoECase(M=4, H=64, I=32, E=4, k=2), torch.bfloat16, seed=12)
    layer = cpumoe.FusedMoE(p.w13, p.w2, top_k=2)
    logits = torch.randn(4, 4)
    with pytest.raises(ValueError, match="hidden_states must be"):
        layer(p.x[:, :32], logits)
    with pytest.raises(ValueError, match="differs from the weights'"):
        layer(p.x.float(), logits)
    with pytest.raises(ValueError, match="router_logits must be"):
        layer(p.x, logits[:3])
    assert one_calls == []
    wide = torch.cat([p.x, p.x], dim=1)[:, :64]  # not contiguous: the binding takes a contiguous copy
    assert torch.equal(layer(wide, logits), two_ops(layer, p.x, logits))
    assert len(one_calls) == 1


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # the shape checks: constants in the trace
def test_fake_tensors_and_jit_tracing_take_the_ops(one_calls):
    from torch._subclasses.fake_tensor import FakeTensorMode
    p = make_problem(MoECase(M=4, H=64, I=32, E=4, k=2), torch.bfloat16, seed=13)
    layer = cpumoe.FusedMoE(p.w13, p.w2, top_k=2)
    logits = torch.randn(4, 4)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:  # the packed weights stay real
        out = layer(mode.from_tensor(p.x), mode.from_tensor(logits))
    assert (out.shape, out.dtype) == (p.x.shape, p.x.dtype)
    traced = torch.jit.trace(layer, (p.x, logits), check_trace=False)
    assert one_calls == []
    other = torch.randn(4, 4, generator=torch.Generator().manual_seed(14))
    assert torch.equal(traced(p.x, other), two_ops(layer, p.x, other))  # the graph routes, not the traced ids


def layer_and_calls(rows: int, calls: int, seed: int) -> tuple:
    """A small bf16 layer, `calls` inputs of `rows` tokens and what the two ops give for each."""
    p = make_problem(MoECase(M=rows, H=64, I=32, E=4, k=2), torch.bfloat16, seed=seed)
    layer = cpumoe.FusedMoE(p.w13, p.w2, top_k=2)
    g = torch.Generator().manual_seed(seed + 1)
    inputs = [(torch.randn(rows, 64, generator=g).bfloat16(), torch.randn(rows, 4, generator=g)) for _ in range(calls)]
    return layer, inputs, [two_ops(layer, x, logits) for x, logits in inputs]


def test_an_output_still_held_is_never_written_again():
    layer, inputs, want = layer_and_calls(rows=3, calls=4, seed=15)
    held = layer(*inputs[0])                 # held by the caller
    view = layer(*inputs[1])[1:]             # only a view of the output is held
    ptr = layer(*inputs[2]).data_ptr()       # dropped: the next call may write into it
    last = layer(*inputs[3])
    assert torch.equal(held, want[0]) and torch.equal(view, want[1][1:]) and torch.equal(last, want[3])
    assert last.data_ptr() == ptr            # the kept output was reused, not reallocated
    with torch.inference_mode():
        inference = layer(*inputs[0]).data_ptr()
    out = layer(*inputs[0])                  # outside inference mode: not the inference tensor kept above
    assert not out.is_inference() and out.data_ptr() != inference and torch.equal(out, want[0])
    out.requires_grad_()                     # changed by its holder, then dropped: not reused
    ptr = out.data_ptr()
    del out
    out = layer(*inputs[1])
    assert out.data_ptr() != ptr and not out.requires_grad and torch.equal(out, want[1])


def test_threads_calling_one_layer_get_their_own_results():
    import threading
    layer, inputs, want = layer_and_calls(rows=2, calls=2, seed=17)
    wrong = []

    def calls(i: int) -> None:
        for _ in range(200):
            if not torch.equal(layer(*inputs[i]), want[i]):
                wrong.append(i)

    threads = [threading.Thread(target=calls, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
