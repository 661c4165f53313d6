"""The guard bytes the kernel tests run with (tests/kernels/conftest.py): outputs sit between guard bytes, a write
before or past an output is reported naming where, and guarded outputs hold the same values as plain ones."""
import pytest
import torch

from cpumoe import ops


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """A flat view of t's whole storage, guard bytes included."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def _rms_norm() -> torch.Tensor:
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    return ops.rms_norm(x, torch.ones(40, dtype=torch.bfloat16), 1e-6)


def test_outputs_sit_between_guard_bytes():
    out = _rms_norm()
    raw = _whole_storage(out)
    begin = out.storage_offset() * out.element_size()
    end = begin + out.numel() * out.element_size()
    assert begin >= 256 and raw.numel() - end >= 256
    assert (raw[:begin] == 0xA5).all() and (raw[end:] == 0xA5).all()
    ops._C.check_output_guards(out)  # untouched: passes


@pytest.mark.parametrize("where", ["past", "before"])
def test_a_write_outside_an_output_is_reported(where):
    out = _rms_norm()
    raw = _whole_storage(out)
    begin = out.storage_offset() * out.element_size()
    end = begin + out.numel() * out.element_size()
    raw[end + 3 if where == "past" else begin - 1] = 0
    with pytest.raises(RuntimeError, match=f"wrote .* {where} its output"):
        ops._C.check_output_guards(out)


def test_guarded_outputs_equal_plain_ones():
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    guarded = ops.rms_norm(x, w, 1e-6)
    ops._C.set_output_guards(False)
    plain = ops.rms_norm(x, w, 1e-6)
    assert plain.storage_offset() == 0 and torch.equal(guarded, plain)
