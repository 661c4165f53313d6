"""cpumoe.ops.linear (dense projections on the experts' w2 tiles) against torch's linear, every native backend."""
import pytest
import torch
import torch.nn.functional as F

from cpumoe import ops
from tests.kernels.moe_cases import assert_fake_matches, backend_dtype_grid
from tests.kernels.tolerances import assert_moe_close

SHAPES = [(1, 64, 32), (3, 100, 70), (17, 130, 2048), (300, 64, 96), (1, 4096, 2048)]  # (M, N, K)
NATIVE = [p for p in backend_dtype_grid() if p.values[0] != "naive"]


@pytest.mark.parametrize("backend,dtype", NATIVE)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}-N{}-K{}".format(*s))
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_linear_matches_torch(backend, dtype, shape, bias):
    M, N, K = shape
    g = torch.Generator().manual_seed(M * 7 + N)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    out = ops.linear(x, ops.pack_linear(w, backend), b, backend=backend, out_features=N)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    assert_moe_close(out, ref, dtype, f"{backend} {dtype} M{M} N{N} K{K}")


def test_linear_keeps_leading_dims_and_checks_shapes():
    backend, dtype = NATIVE[0].values
    packed = ops.pack_linear(torch.randn(48, 64).to(dtype), backend)
    x = torch.randn(2, 3, 64).to(dtype)
    assert ops.linear(x, packed, None, backend=backend, out_features=48).shape == (2, 3, 48)
    with pytest.raises(ValueError, match=r"packed as \[48, 64\] \(out, in\), the call has x of width 32"):
        ops.linear(torch.randn(4, 32).to(dtype), packed, None, backend=backend, out_features=48)


def test_linear_refuses_what_rounds_to_the_same_blocks():
    """Widths and out_features that pad to the packed blocks used to run on silently (zero or garbage columns)."""
    backend, dtype = NATIVE[0].values
    packed = ops.pack_linear(torch.randn(100, 64).to(dtype), backend)
    x = torch.randn(3, 64).to(dtype)
    assert ops.linear(x, packed, None, backend=backend, out_features=100).shape == (3, 100)
    for width, out in ((60, 100), (64, 120), (64, 90)):
        with pytest.raises(ValueError, match=rf"packed as \[100, 64\].*width {width} and out_features {out}"):
            ops.linear(torch.randn(3, width).to(dtype), packed, None, backend=backend, out_features=out)
    with pytest.raises(ValueError, match="packed linear weight is not a weight packed by cpumoe"):
        ops.linear(x, packed.clone(), None, backend=backend, out_features=100)
    layout = {name: (lay, dtypes) for name, _, lay, _, dtypes, _ in ops._C.kernel_backends()}
    for other, (lay, dtypes) in layout.items():
        if lay and lay != layout[backend][0] and str(dtype).removeprefix("torch.") in dtypes:
            with pytest.raises(ValueError, match=f"packed as backend '{backend}'.*this call runs backend '{other}'"):
                ops.linear(x, packed, None, backend=other, out_features=100)


def test_linear_fake_kernel():
    backend, dtype = NATIVE[0].values
    packed = ops.pack_linear(torch.randn(48, 64).to(dtype), backend)
    assert_fake_matches(torch.ops.cpumoe.linear.default, (torch.randn(5, 64).to(dtype), packed, None),
                        dict(backend=backend, out_features=48))
