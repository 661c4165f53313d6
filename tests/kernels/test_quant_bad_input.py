"""Quantized ops and layers given bad input raise errors that name the problem; the oracle says why each backend
refuses a quantized layer and falls through."""
import pytest
import torch

import cpumoe
from cpumoe import ops
from cpumoe.experts import ExpertsConfig, backend_report, choose_backend
from cpumoe.quant import quantize


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 128, 128, generator=g) / 11, torch.randn(4, 128, 64, generator=g) / 8  # w13, w2


def pack(qw, **kw):
    args = dict(format=qw.format.value, group_size=qw.group_size, w13=True) | kw
    return ops.pack_quant(qw.qweight, qw.scales, qw.zeros, **args)


def test_pack_checks_codes_scales_zeros(weights):
    q = quantize(weights[0], "int4", 64)
    with pytest.raises(ValueError, match="w13 qweight of int4_w4a16 must be Byte"):
        ops.pack_quant(q.qweight.to(torch.int8), q.scales, None, format="int4_w4a16", group_size=64, w13=True)
    with pytest.raises(ValueError, match=r"int4_w4a16 scales must be Float \[4, 128, 2\]"):
        ops.pack_quant(q.qweight, q.scales[..., :1].contiguous(), None, format="int4_w4a16", group_size=64, w13=True)
    with pytest.raises(ValueError, match="int4 group size 48 must be a multiple of 32 dividing K=128"):
        ops.pack_quant(q.qweight, q.scales, None, format="int4_w4a16", group_size=48, w13=True)
    with pytest.raises(ValueError, match="fp8_w8a16 takes no zero points"):
        f = quantize(weights[0], "fp8")
        ops.pack_quant(f.qweight, f.scales, q.scales.to(torch.uint8), format="fp8_w8a16", group_size=128, w13=True)
    with pytest.raises(ValueError, match="unknown quantization format 'int5'"):
        ops.pack_quant(q.qweight, q.scales, None, format="int5", group_size=64, w13=True)
    with pytest.raises(ValueError, match="mxfp4 needs K=70"):
        ops.pack_quant(torch.zeros(1, 64, 70, dtype=torch.uint8), torch.zeros(1, 64, 2, dtype=torch.uint8), None,
                       format="mxfp4_w4a16", group_size=32, w13=False)


def test_op_checks_packed_weights(weights):
    w13, w2 = quantize(weights[0], "int8"), quantize(weights[1], "int8")
    p13, p2 = pack(w13, group_size=0), pack(w2, group_size=0, w13=False)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    tw, ti = torch.full((3, 1), 1.0), torch.zeros(3, 1, dtype=torch.int32)
    kw = dict(backend="generic", format="int8_w8a8", group_size=0)
    assert ops.fused_experts_quant(x, p13, p2, tw, ti, **kw).shape == (3, 128)
    with pytest.raises(ValueError, match="width 64 but the experts were packed for hidden size 128"):
        ops.fused_experts_quant(x[:, :64].contiguous(), p13, p2, tw, ti, **kw)  # packed for H=128, given 64
    with pytest.raises(ValueError, match="packed w2 is not a weight packed by cpumoe"):
        ops.fused_experts_quant(x, p13, p2[:, :1].contiguous(), tw, ti, **kw)
    with pytest.raises(ValueError, match="swapped or mixed"):
        ops.fused_experts_quant(x, p2, p13, tw, ti, **kw)
    with pytest.raises(ValueError, match="packed w13 must be the uint8 blocks"):
        ops.fused_experts_quant(x, p13.view(torch.int8), p2, tw, ti, **kw)
    with pytest.raises(ValueError, match="fp8_w8a16 takes bfloat16 activations"):
        ops.fused_experts_quant(x.float(), p13, p2, tw, ti, backend="generic", format="fp8_w8a16", group_size=128)
    with pytest.raises(RuntimeError, match="kernel backend 'x86-avx512' cannot run int8_w8a8"):
        ops.fused_experts_quant(x, p13, p2, tw, ti, backend="x86-avx512", format="int8_w8a8", group_size=0)
    with pytest.raises(ValueError, match="topk_ids holds expert id 9"):
        ops.fused_experts_quant(x, p13, p2, tw, torch.full((3, 1), 9, dtype=torch.int32), **kw)


def test_layer_checks(weights):
    w13, w2 = quantize(weights[0], "int4", 64), quantize(weights[1], "int4", 64)
    with pytest.raises(ValueError, match="w13 and w2 must be QuantizedWeights of one format"):
        cpumoe.FusedMoE.from_quantized(w13, quantize(weights[1], "int8"), top_k=1)
    with pytest.raises(ValueError, match="w2 must be"):
        cpumoe.FusedMoE.from_quantized(w13, quantize(weights[1][:, :64].contiguous(), "int4", 64), top_k=1)
    layer = cpumoe.FusedMoE.from_quantized(w13, w2, top_k=1)
    with pytest.raises(ValueError, match="dtype torch.float32 differs"):
        layer(torch.zeros(2, 128), torch.zeros(2, 4))


def test_every_backend_says_why_and_the_oracle_falls_through():
    fp8_fp16 = ExpertsConfig(hidden_size=128, inter_size=64, num_experts=4, top_k=1, dtype=torch.float16,
                             quantization="fp8_w8a16", group_size=128)
    report = {name: (ok, why) for name, ok, why in backend_report(fp8_fp16)}
    assert report["generic"] == (False, "fp8_w8a16 takes bfloat16 activations, not torch.float16")
    ok, why = report["x86-avx512"]  # no fp8 tiles; or, off an AVX-512 x86 CPU, not runnable here at all
    assert not ok and any(reason in why for reason in ("has no fp8_w8a16 tiles", "not built", "CPU lacks")), why
    assert choose_backend(fp8_fp16).name == "naive"  # dequantizes at load: the last resort, logged with the reasons
    int8 = ExpertsConfig(hidden_size=128, inter_size=64, num_experts=4, top_k=1, dtype=torch.bfloat16,
                         quantization="int8_w8a8", group_size=0)
    assert choose_backend(int8).name != "naive"
