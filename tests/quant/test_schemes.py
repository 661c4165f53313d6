"""cpumoe.quant: each format's quantizer and dequantizer (round trips and error bounds), validation, and the
per-token activation quantization every A8 kernel copies."""
import pytest
import torch

from cpumoe.quant import QuantFormat, QuantizedWeight, concat_rows, dequantize, quantize, quantize_activations
from cpumoe.quant.schemes import E2M1_VALUES


@pytest.fixture
def w():
    return torch.randn(3, 70, 256, generator=torch.Generator().manual_seed(0))


def test_int8_per_channel_error_is_half_a_step(w):
    q = quantize(w, "int8")
    step = q.scales[..., None]
    assert (dequantize(q) - w).abs().le(step / 2 + 1e-6).all()
    assert q.qweight.abs().max() == 127  # each row's max lands on the last code


@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_groups_error_is_bounded(w, group, symmetric):
    q = quantize(w, "int4", group, symmetric=symmetric)
    q.validate()
    assert q.qweight.max() <= 15 and (q.zeros is None) == symmetric
    step = q.scales.repeat_interleave(group, dim=-1)
    bound = step if symmetric else step / 2 + step  # asymmetric: the zero point is rounded too
    assert (dequantize(q) - w).abs().le(bound + 1e-6).all()


def test_int4_codes_round_trip_through_dequantize(w):
    q = quantize(w, "int4", 64, symmetric=False)
    again = quantize(dequantize(q), "int4", 64, symmetric=False)
    assert (dequantize(again) - dequantize(q)).abs().max() < 1e-5 * w.abs().max()


@pytest.mark.parametrize("block", [128, 32])
def test_fp8_block_scales(w, block):
    q = quantize(w, "fp8", block)
    assert q.scales.shape == (3, 70, 256 // block)
    # rows of one 128-row block share their scales
    assert torch.equal(q.scales[:, 0], q.scales[:, min(block, 70) - 1])
    rel = (dequantize(q) - w).abs() / w.abs().clamp(min=1e-3)
    assert rel[w.abs() > 0.1].max() <= 2.0 ** -4  # e4m3's half ulp


def test_mxfp4_values_and_scales(w):
    q = quantize(w, "mxfp4")
    deq = dequantize(q)
    exps = torch.ldexp(torch.ones(q.scales.shape), q.scales.int() - 127).repeat_interleave(32, dim=-1)
    codes_values = deq / exps
    assert torch.isin(codes_values, E2M1_VALUES).all()
    # OCP's scale (2^(floor(log2 max) - 2)) puts a group's max in [4, 8): above 6 it clips, by up to 2 steps of 2^e
    assert (deq - w).abs().le(2 * exps).all()


def test_mxfp4_of_exact_values_is_exact():
    exact = E2M1_VALUES[torch.randint(0, 16, (4, 64), generator=torch.Generator().manual_seed(1))] * 4.0
    exact[:, 0] = 6.0 * 4.0  # every group of 32 holds the top value, so its scale is 2^2
    exact[:, 32] = -6.0 * 4.0
    assert torch.equal(dequantize(quantize(exact, "mxfp4")), exact)


def test_mxfp4_rounds_to_the_nearest_value_and_ties_to_the_smaller_magnitude():
    # a group's max of 6 x 2^0 sets its exponent to 0; then each E2M1 midpoint, and values just either side of it
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    row = torch.cat([torch.tensor([6.0]), mids, -mids, mids + 1e-6, mids - 1e-6, torch.tensor([7.9, 0.0] * 2)])
    q = quantize(torch.cat([row, torch.zeros(32 - row.numel() % 32)])[None], "mxfp4")
    values = dequantize(q)[0, :row.numel()]
    below = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    assert torch.equal(values[1:8], below) and torch.equal(values[8:15], -below)
    assert torch.equal(values[15:22], below.roll(-1).index_put_((torch.tensor([6]),), torch.tensor(6.0)))
    assert torch.equal(values[22:29], below)
    assert values[29] == 6.0  # clipped


@pytest.mark.parametrize("fmt,group", [("int8", None), ("int4", 32), ("fp8", 128), ("fp8", 64), ("mxfp4", None)])
@pytest.mark.parametrize("shape", [(9, 70, 256), (300, 256)])
def test_quantize_takes_a_large_weight_in_slices_with_the_same_result(monkeypatch, fmt, group, shape):
    from cpumoe.quant import schemes

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    whole = quantize(w, fmt, group)
    monkeypatch.setattr(schemes, "SLICE_ELEMENTS", 3 * 70 * 256 if len(shape) == 3 else 50 * 256)
    assert schemes._slice_step(w, whole.format, group) < shape[0]
    sliced = quantize(w, fmt, group)
    for name in ("qweight", "scales", "zeros"):
        a, b = getattr(whole, name), getattr(sliced, name)
        assert (a is None and b is None) or torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                                        b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


def test_activation_quantization_rounds_half_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, 0.0], [0.0] * 5])
    q, s = quantize_activations(x)
    assert s.tolist() == [1.0, 0.0]
    assert q.tolist() == [[127, 0, 2, -2, 0], [0] * 5]


@pytest.mark.parametrize("bad, match", [
    (lambda q: QuantizedWeight(q.format, q.qweight.float(), q.scales, None, 64), "qweight must be torch.uint8"),
    (lambda q: QuantizedWeight(q.format, q.qweight, q.scales[..., :1], None, 64), "scales must be"),
    (lambda q: QuantizedWeight(q.format, q.qweight, q.scales, None, 48), "group size 48"),
    (lambda q: QuantizedWeight(q.format, q.qweight, q.scales, q.scales.to(torch.uint8)[..., :1], 64), "zeros"),
], ids=["codes-dtype", "scales-shape", "group", "zeros-shape"])
def test_validate_names_the_problem(w, bad, match):
    with pytest.raises(ValueError, match=match):
        bad(quantize(w, "int4", 64)).validate()


def test_concat_rows_keeps_each_rows_scales(w):
    gate, up = quantize(w[0], "fp8"), quantize(w[1], "fp8")
    both = concat_rows([gate, up])
    assert both.shape == (140, 256)
    assert torch.equal(dequantize(both), torch.cat([dequantize(gate), dequantize(up)]))


def test_format_names():
    assert QuantFormat("int8_w8a8").int8_activations and not QuantFormat("fp8_w8a16").int8_activations
    with pytest.raises(ValueError, match="unknown quantization format 'int3'"):
        quantize(torch.zeros(2, 32), "int3")
