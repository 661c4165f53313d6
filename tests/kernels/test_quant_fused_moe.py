"""Every kernel backend that runs a quantized format, against cpumoe.reference.quantized_fused_experts, over shape,
group, activation and routing grids. Backends come from the registry, so a new ISA unit is covered as it lands."""
import pytest
import torch

import cpumoe
from cpumoe import reference
from cpumoe.experts import ExpertsConfig, all_backends
from cpumoe.quant import QuantFormat, QuantizedWeight, dequantize, quantize
from tests.kernels.moe_cases import MoECase, make_problem
from tests.kernels.tolerances import assert_quant_close

# (format, group_size, symmetric): int4 in its four group sizes, with and without zero points.
SCHEMES = [
    ("int8_w8a8", None, True),
    ("int4_w4a16", 32, True),
    ("int4_w4a16", 64, False),
    ("int4_w4a16", 128, True),
    ("int4_w4a16", 0, False),  # a whole row
    ("fp8_w8a16", 128, True),
    ("fp8_w8a16", 32, True),
    ("fp8_w8a16", 256, True),  # k blocks wider than the AVX2 tiles' chunks of 128
    ("mxfp4_w4a16", None, True),
]


def native_backends_for(fmt: str, dtype: torch.dtype) -> list[str]:
    config = ExpertsConfig(hidden_size=64, inter_size=32, num_experts=2, top_k=1, dtype=dtype, quantization=fmt)
    return [p.name for p in all_backends() if p.name != "naive" and p.is_supported(config)[0]]


def scheme_id(fmt, group, sym):
    return f"{QuantFormat(fmt).name.split('_')[0].lower()}" + (f"-g{group}" if group is not None else "") + \
        ("" if sym else "-asym")


def grid(dtypes=(torch.bfloat16, torch.float32)):
    out = []
    for fmt, group, sym in SCHEMES:
        for dtype in dtypes:
            if not QuantFormat(fmt).int8_activations and dtype != torch.bfloat16:
                continue
            for backend in native_backends_for(fmt, dtype):
                dtype_id = str(dtype).removeprefix("torch.")
                out.append(pytest.param(backend, fmt, group, sym, dtype,
                                        id=f"{backend}-{scheme_id(fmt, group, sym)}-{dtype_id}"))
    return out


def fits(case: MoECase, fmt: str, group) -> bool:
    """Group sizes must divide both K's (H for w13, I for w2); mxfp4 needs multiples of 32."""
    if fmt == "mxfp4_w4a16" or (fmt == "int4_w4a16" and group):
        g = 32 if fmt == "mxfp4_w4a16" else group
        return case.H % g == 0 and case.I % g == 0
    return True


def quantized(p, fmt, group, sym):
    group_size = None if group is None else group
    kw = dict(symmetric=sym) if fmt == "int4_w4a16" else {}
    if fmt == "int4_w4a16" and group == 0:
        return (quantize(p.w13, fmt, p.w13.shape[-1], **kw), quantize(p.w2, fmt, p.w2.shape[-1], **kw))
    return quantize(p.w13, fmt, group_size, **kw), quantize(p.w2, fmt, group_size, **kw)


def check(backend, fmt, group, sym, dtype, p, msg, *, activation="silu", expert_map=None, num_experts=None,
          on_input=False):
    E, two_i, H = p.w13.shape
    if not fits(MoECase(M=1, H=H, I=two_i // 2, E=E, k=1), fmt, group):
        pytest.skip(f"the group of {fmt} does not divide H={H} and I={two_i // 2}")
    w13, w2 = quantized(p, fmt, group, sym)
    layer = cpumoe.FusedMoE.from_quantized(w13, w2, top_k=p.topk_ids.shape[1], dtype=dtype, activation=activation,
                                           w13_bias=p.w13_bias, w2_bias=p.w2_bias, expert_map=expert_map,
                                           num_experts=num_experts, apply_router_weight_on_input=on_input,
                                           backend=backend)
    assert layer.backend == backend and layer.quantization == fmt
    out = layer.experts(p.x, p.topk_weights, p.topk_ids)
    ref = reference.quantized_fused_experts(p.x, w13, w2, p.topk_weights, p.topk_ids, activation=activation,
                                            w13_bias=p.w13_bias, w2_bias=p.w2_bias, expert_map=expert_map,
                                            apply_router_weight_on_input=on_input)
    assert_quant_close(out, ref, dtype, msg)


SHAPES = [
    MoECase(M=1, H=64, I=32, E=1, k=1),
    MoECase(M=2, H=128, I=64, E=8, k=2),
    MoECase(M=7, H=130, I=70, E=8, k=2),      # K not a multiple of 32: padded
    MoECase(M=33, H=256, I=128, E=8, k=8),    # every expert active, several int4 groups
    MoECase(M=300, H=128, I=96, E=32, k=4),   # prefill-sized tiles
    MoECase(M=5, H=63, I=17, E=3, k=1),       # odd sizes
    MoECase(M=9, H=2048, I=768, E=4, k=2),    # real qwen3 per-expert shapes
    MoECase(M=512, H=520, I=64, E=16, k=8),   # w2 outputs past 8 MB: written past the caches, a narrow last block
]


@pytest.mark.parametrize("backend,fmt,group,sym,dtype", grid())
@pytest.mark.parametrize("case", SHAPES, ids=lambda c: c.id)
def test_shapes(backend, fmt, group, sym, dtype, case):
    check(backend, fmt, group, sym, dtype, make_problem(case, dtype), f"{backend} {fmt} g{group} {case.id}")


@pytest.mark.parametrize("backend,fmt,group,sym,dtype", grid(dtypes=(torch.bfloat16,)))
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "swigluoai"])
def test_activations_with_bias(backend, fmt, group, sym, dtype, activation):
    case = MoECase(M=17, H=256, I=128, E=8, k=2)
    check(backend, fmt, group, sym, dtype, make_problem(case, dtype, bias=True), f"{backend} {fmt} {activation}",
          activation=activation)


@pytest.mark.parametrize("backend,fmt,group,sym,dtype", grid(dtypes=(torch.bfloat16,)))
def test_skewed_routing_and_expert_map(backend, fmt, group, sym, dtype):
    case = MoECase(M=40, H=256, I=128, E=8, k=2)
    skewed = torch.stack([torch.zeros(40, dtype=torch.int32), torch.arange(40, dtype=torch.int32) % 8], dim=1)
    skewed[:, 1] = torch.where(skewed[:, 1] == 0, 1, skewed[:, 1])  # no token picks expert 0 twice
    check(backend, fmt, group, sym, dtype, make_problem(case, dtype, topk_ids=skewed), f"{backend} {fmt} skewed")
    local = make_problem(MoECase(M=29, H=256, I=128, E=3, k=2), dtype)
    ids = torch.randint(0, 8, (29, 2), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    ids[:, 1] = (ids[:, 0] + 1 + ids[:, 1] % 7) % 8
    local.topk_ids = ids
    expert_map = torch.full((8,), -1, dtype=torch.int32)
    expert_map[torch.tensor([1, 4, 6])] = torch.arange(3, dtype=torch.int32)
    check(backend, fmt, group, sym, dtype, local, f"{backend} {fmt} expert_map", expert_map=expert_map, num_experts=8)


@pytest.mark.parametrize("backend,fmt,group,sym,dtype",
                         [p for p in grid(dtypes=(torch.bfloat16,)) if QuantFormat(p.values[1]).int8_activations])
def test_intermediate_past_the_caches(backend, fmt, group, sym, dtype):
    # 2048 slot rows x I = 1024 float32 intermediates: 8 MB, which w13 writes past the caches for the A8 formats.
    case = MoECase(M=256, H=128, I=1024, E=8, k=8)
    check(backend, fmt, group, sym, dtype, make_problem(case, dtype), f"{backend} {fmt} 8 MB intermediate")


@pytest.mark.parametrize("backend,fmt,group,sym,dtype", grid(dtypes=(torch.bfloat16,)))
def test_router_weight_on_input(backend, fmt, group, sym, dtype):
    case = MoECase(M=11, H=256, I=128, E=4, k=1)
    check(backend, fmt, group, sym, dtype, make_problem(case, dtype), f"{backend} {fmt} on_input", on_input=True)


@pytest.mark.parametrize("backend,fmt,group,sym,dtype", grid())
@pytest.mark.parametrize("M,K,N", [(1, 128, 64), (5, 130, 70), (37, 2048, 256)], ids=lambda v: str(v))
def test_linear(backend, fmt, group, sym, dtype, M, K, N):
    from cpumoe.models.packed_linear import QuantizedLinear
    if not fits(MoECase(M=M, H=K, I=K, E=1, k=1), fmt, group):
        pytest.skip("group does not divide K")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(N, K, generator=g) / K**0.5
    x = torch.randn(M, K, generator=g).to(dtype)
    kw = dict(symmetric=sym) if fmt == "int4_w4a16" else {}
    qw = quantize(w, fmt, K if group == 0 else group, **kw)
    layer = QuantizedLinear(qw, has_bias=True, dtype=dtype, backend=backend)
    layer.bias = torch.nn.Parameter(torch.randn(N, generator=g).to(dtype), requires_grad=False)
    assert layer.backend == backend
    assert_quant_close(layer(x), reference.quantized_linear(x, qw, layer.bias), dtype, f"{backend} {fmt} linear")


@pytest.mark.parametrize("backend", native_backends_for("fp8_w8a16", torch.bfloat16))
@pytest.mark.parametrize("flush_denormal", [False, True], ids=["subnormals-kept", "set-flush-denormal"])
@pytest.mark.parametrize("M", [1, 2, 5])
def test_fp8_subnormal_codes_and_activations_far_from_one(backend, flush_denormal, M):
    """fp8 codes that are all e4m3 subnormals (their value's exponent field 0), against activation rows of 1e30,
    1e-30 and a mix of both in one row: a tile that builds f32s from the codes' bits or scales the activations must
    keep every term, whatever MXCSR's denormals-are-zero bit says (torch.set_flush_denormal sets it on the calling
    thread, which runs the whole op with one thread). Compared with float64 maths relative to each row's largest
    output, since the float32 reference itself would underflow here."""
    from cpumoe.models.packed_linear import QuantizedLinear
    from cpumoe.quant import dequantize
    K, N = 256, 64
    g = torch.Generator().manual_seed(3)
    qw = quantize(torch.randn(N, K, generator=g), "fp8_w8a16", 128)
    magnitude = torch.randint(1, 8, (N, K), generator=g, dtype=torch.uint8)
    sign = torch.randint(0, 2, (N, K), generator=g, dtype=torch.uint8) << 7
    qw.qweight = (magnitude | sign).view(torch.float8_e4m3fn)
    layer = QuantizedLinear(qw, has_bias=False, dtype=torch.bfloat16, backend=backend)
    rows = torch.randn(3, K, generator=g)
    rows[0] *= 1e30
    rows[1] *= 1e-30
    rows[2, ::2] *= 1e-30  # tiny terms beside ordinary ones: they may round away, the ordinary ones may not
    x = rows[torch.arange(M) % 3].to(torch.bfloat16)
    expected = x.double() @ dequantize(qw).double().T
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.set_flush_denormal(flush_denormal) or not flush_denormal
        y = layer(x)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    for r in range(M):
        scale = expected[r].abs().max().item()
        assert scale > 0
        err = (y[r].double() - expected[r]).abs().max().item() / scale
        assert err < 1e-2, f"{backend} row {r} (x {x[r].abs().max().item():.3g}): error {err:.3g} of the largest output"


@pytest.mark.parametrize("backend", native_backends_for("fp8_w8a16", torch.bfloat16))
@pytest.mark.parametrize("M", [2, 6, 16])
def test_fp8_zero_exponent_codes_in_a_few_k_pairs(backend, M):
    """Zeros (both signs) and subnormals in a few k-pairs of otherwise normal fp8 codes: the packed block marks
    exactly those k-pairs (quant.h: a bit per k-pair after the scales), a k-pair whose only zero exponent lies in
    its second k or its last column included, and each backend gives those weights' values to the bit. Row i
    reads the weights at one placed k alone (a one-hot row), so each output is one product, the same bits in any
    order of sums: a code widened as if its exponent were normal would show (a zero as 2^-7 of its scale)."""
    from cpumoe.models.packed_linear import QuantizedLinear
    K, N = 320, 64  # 160 k-pairs: two bit words and a part of a third
    g = torch.Generator().manual_seed(5)
    qw = quantize(torch.randn(N, K, generator=g), "fp8_w8a16", 128)
    codes = qw.qweight.view(torch.uint8).clone()
    codes[(codes & 0x78) == 0] |= 0x08  # no zero exponents but the ones placed below
    placed = [(0, 0, 0x00), (5, 7, 0x80), (63, 65, 0x03), (17, 128, 0x85), (40, 319, 0x01), (2, 200, 0x06)]
    for n, k, code in placed:
        codes[n, k] = code
    qw.qweight = codes.view(torch.float8_e4m3fn)
    layer = QuantizedLinear(qw, has_bias=False, dtype=torch.bfloat16, backend=backend)
    block = layer.packed_weight.view(torch.uint8).reshape(-1)
    bits_at = 64 * K + 256 * 3  # the codes, then 3 k-chunks of scales
    bits = int.from_bytes(block[bits_at:bits_at + K // 16].numpy().tobytes(), "little")
    assert bits == sum(1 << p for p in {k // 2 for _, k, _ in placed})
    x = torch.zeros(M, K, dtype=torch.bfloat16)
    for i in range(M):
        x[i, placed[i % len(placed)][1]] = 1.0
    y, expected = layer(x), reference.quantized_linear(x, qw, None)
    for i in range(M):
        n, k, code = placed[i % len(placed)]
        assert torch.equal(y[i], expected[i]), f"{backend}: code {code:#04x} at column {n}, k {k}"
    assert y[0, 0] == 0


@pytest.mark.parametrize("backend", native_backends_for("int8_w8a8", torch.float32))
def test_activation_rounding_ties_and_nan(backend):
    """Each backend's build of the A8 row quantizer (quant_row.h): ties round to even as torch.round, a row's
    largest value maps to 127, a zero row to zeros, and a NaN row gives NaN (its scale is NaN), never a crash or a
    finite lie. K = 40 runs both a vector body and a scalar tail at every vector width."""
    from cpumoe.models.packed_linear import QuantizedLinear
    K = 40  # not a multiple of 32: the padded tail must not count
    w = torch.eye(K)
    qw = quantize(w, "int8_w8a8")  # per-channel scale 1/127 on an identity: exact
    layer = QuantizedLinear(qw, has_bias=False, dtype=torch.float32, backend=backend)
    x = torch.zeros(3, K)
    x[0, :6] = torch.tensor([127.0, 0.5, 1.5, -2.5, 2.5, -0.5])
    x[0, 6:] = torch.arange(K - 6) * 3.5 - 60.0  # x.5 values of both signs: every tie is rounded to even
    x[2, 3] = float("nan")
    y = layer(x)
    assert torch.equal(y[0], x[0].round()), (y[0], x[0].round())
    assert torch.equal(y[1], torch.zeros(K))
    assert torch.isnan(y[2]).all()


def _zero_points_of_8(w):
    """The same int4 weight with its implied zero points written out: 8 for every group."""
    return torch.full_like(w.scales, 8, dtype=torch.uint8)


@pytest.mark.parametrize("backend", native_backends_for("int4_w4a16", torch.bfloat16))
@pytest.mark.parametrize("group", [32, 128, 0], ids=["g32", "g128", "row"])
def test_symmetric_int4_packs_without_zero_points(backend, group):
    """Symmetric int4 (no zeros) packs scales alone: 256 bytes a group instead of 512, and every tile gives the bits
    of the same weights packed with zero points of 8, in the fused experts and the dense linear."""
    p = make_problem(MoECase(M=9, H=256, I=128, E=4, k=2), torch.bfloat16)
    w13, w2 = quantized(p, "int4_w4a16", group, True)
    assert w13.zeros is None
    ops = cpumoe.ops
    packs = {}
    for name, w, is_w13 in (("w13", w13, True), ("w2", w2, False)):
        sym = ops.pack_quant(w.qweight, w.scales, None, format="int4_w4a16", group_size=group, w13=is_w13)
        zp = ops.pack_quant(w.qweight, w.scales, _zero_points_of_8(w), format="int4_w4a16", group_size=group,
                            w13=is_w13)
        K, Kp = w.qweight.shape[-1], (w.qweight.shape[-1] + 31) // 32 * 32
        groups = Kp // (group or Kp)
        assert sym.shape[-1] == 32 * Kp + 256 * groups and zp.shape[-1] == 32 * Kp + 512 * groups
        assert ops.quant_packed_shape("int4_w4a16", w.qweight.shape[1], K, group, is_w13, symmetric=True)[1] == \
            sym.shape[-1]
        packs[name] = (sym, zp)
    call = dict(backend=backend, format="int4_w4a16", group_size=group, activation="silu")
    sym_out = ops.fused_experts_quant(p.x, packs["w13"][0], packs["w2"][0], p.topk_weights, p.topk_ids, **call)
    zp_out = ops.fused_experts_quant(p.x, packs["w13"][1], packs["w2"][1], p.topk_weights, p.topk_ids, **call)
    assert torch.equal(sym_out, zp_out)
    # one expert's w2 [H, I] as a linear of I -> H
    lin = {kind: ops.pack_quant(w2.qweight[:1], w2.scales[:1], zeros, format="int4_w4a16",
                                group_size=group, w13=False)
           for kind, zeros in (("sym", None), ("zp", _zero_points_of_8(w2)[:1]))}
    x = p.x[:, :w2.qweight.shape[-1]].contiguous()
    outs = [ops.linear_quant(x, lin[kind], None, backend=backend, format="int4_w4a16",
                             group_size=group, out_features=w2.qweight.shape[1])
            for kind in ("sym", "zp")]
    assert torch.equal(outs[0], outs[1])


def test_symmetric_and_zero_point_int4_do_not_join():
    """join_packed_rows refuses parts of the two int4 packings: their blocks differ in size and layout."""
    w = quantize(torch.randn(64, 128), "int4_w4a16", 32)
    sym = cpumoe.ops.pack_quant(w.qweight[None], w.scales[None], None, format="int4_w4a16", group_size=32, w13=False)
    zp = cpumoe.ops.pack_quant(w.qweight[None], w.scales[None], _zero_points_of_8(w)[None], format="int4_w4a16",
                               group_size=32, w13=False)
    with pytest.raises(ValueError, match="symmetric"):
        cpumoe.ops.join_packed_rows([sym, zp])


@pytest.mark.skipif("x86-amx" not in native_backends_for("int8_w8a8", torch.bfloat16), reason="no AMX-INT8 here")
@pytest.mark.parametrize("fmt,group,sym", [("int8_w8a8", None, True), ("int4_w4a16", 64, True),
                                           ("int4_w4a16", 128, False)], ids=["int8", "int4-g64", "int4-g128-asym"])
@pytest.mark.parametrize("case", [MoECase(M=120, H=160, I=128, E=4, k=2), MoECase(M=120, H=384, I=128, E=4, k=2),
                                  MoECase(M=70, H=2048, I=768, E=2, k=1)], ids=lambda c: c.id)
def test_amx_a8_tiles_give_the_bits_of_the_generic_tiles(fmt, group, sym, case):
    """x86-amx's TDPBUSD / TDPBSUD tiles sum int32 exactly and rescale as the VNNI tiles do: the same bits as
    quant_generic. ~60 scattered rows an expert (whole tiles of 16, a padded one, w13's rows sorted by the driver);
    K = 160 leaves an int8 k-quad tail past the last whole 64; 384 takes int4's groups; then the real qwen3 shapes.
    (mxfp4's prefill sums on bf16 tiles: the tests below.)"""
    if not fits(case, fmt, group):
        pytest.skip(f"group {group} does not divide H={case.H}")
    p = make_problem(case, torch.bfloat16)
    w13, w2 = quantized(p, fmt, group, sym)
    out = {}
    for backend in ("x86-amx", "generic"):
        layer = cpumoe.FusedMoE.from_quantized(w13, w2, top_k=case.k, dtype=torch.bfloat16, backend=backend)
        assert layer.backend == backend
        out[backend] = layer.experts(p.x, p.topk_weights, p.topk_ids)
    assert torch.equal(out["x86-amx"], out["generic"])


def _mxfp4_rows_and_weight(M, N, K, exps, seed=0):
    """Integer activations with 127 in every row (so the A8 codes are the values, scale 1) and random e2m1 codes
    under the given exponents [N, K/32]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (M, K), generator=g).float()
    x[:, 0] = 127
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    return x, QuantizedWeight(QuantFormat.MXFP4_W4A16, codes, exps, None, 32)


def _mxfp4_linear(x, w, backend):
    packed = cpumoe.ops.pack_quant(w.qweight[None], w.scales[None], None, format="mxfp4_w4a16", group_size=32,
                                   w13=False)
    return cpumoe.ops.linear_quant(x, packed, None, backend=backend, format="mxfp4_w4a16", group_size=32,
                                   out_features=w.qweight.shape[0])


@pytest.mark.skipif("x86-amx" not in native_backends_for("mxfp4_w4a16", torch.bfloat16), reason="no AMX here")
@pytest.mark.parametrize("M", [16, 40])
def test_amx_mxfp4_prefill_sums_exact_products_in_float32(M):
    """From 16 rows x86-amx widens an mxfp4 block to bf16 values (exact) and sums the A8 codes (exact in bf16) on
    its bf16 tiles: float32 sums of exact products, so within float32 accumulation of the exact dot, with
    exponents spread over 2^50 in a row, zero groups (e = 0) and the edges of the range (2, 252) kept."""
    N, K = 128, 256
    exps = torch.randint(100, 150, (N, K // 32), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    exps[0, 3] = 0
    exps[1, :] = 0
    exps[2, 0], exps[3, 1] = 2, 180
    x, w = _mxfp4_rows_and_weight(M, N, K, exps)
    values = dequantize(w).double()
    values[exps.repeat_interleave(32, dim=1) == 0] = 0.0  # e = 0: a zero group
    exact = x.double() @ values.T
    bound = 2.0 ** -22 * (x.double().abs() @ values.abs().T)  # a few float32 roundings of the sum of |products|
    for backend in ("x86-amx", "generic"):
        y = _mxfp4_linear(x, w, backend).double()
        assert ((y - exact).abs() <= bound).all(), (backend, (y - exact).abs().max())
        assert torch.equal(y[:, 1], torch.zeros(M, dtype=torch.float64))


@pytest.mark.skipif("x86-amx" not in native_backends_for("mxfp4_w4a16", torch.bfloat16), reason="no AMX here")
@pytest.mark.parametrize("edge", [1, 253, 255])
def test_amx_mxfp4_exponents_outside_bf16_take_the_int8_tiles(edge):
    """A block with an exponent whose values bf16 cannot hold as normal numbers (1: 0.5 x 2^-126; 253 and up: past
    bf16's largest) runs on the TDPBSSD tiles, which give quant_generic's bits; the other blocks are unaffected."""
    N, K, M = 128, 256, 40
    exps = torch.randint(110, 130, (N, K // 32), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    exps[5, 2] = edge
    x, w = _mxfp4_rows_and_weight(M, N, K, exps, seed=3)
    amx, generic = _mxfp4_linear(x, w, "x86-amx"), _mxfp4_linear(x, w, "generic")
    torch.testing.assert_close(amx[:, :64], generic[:, :64], rtol=0, atol=0, equal_nan=True)  # 255: NaNs alike
    finite = generic[:, 64:].isfinite()
    assert torch.allclose(amx[:, 64:][finite], generic[:, 64:][finite], rtol=1e-5, atol=0)
