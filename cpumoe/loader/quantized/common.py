"""What every checkpoint layout shares: checked tensor reads, and the Layout interface each layout implements."""
from __future__ import annotations

from typing import ClassVar

import torch

from cpumoe.loader.checkpoint import Checkpoint, CheckpointError
from cpumoe.quant.formats import QuantFormat, QuantizedWeight

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def read_checked(ckpt: Checkpoint, name: str, dtypes: tuple[torch.dtype, ...], shape: tuple | None = None,
                 what: str = "", index: int | None = None) -> torch.Tensor:
    """The tensor `name` (one slice of dim 0 when index is given), after checking its dtype and shape
    (None entries in `shape` match any size); a CheckpointError naming it otherwise."""
    if name not in ckpt:
        raise CheckpointError(f"{what + ' ' if what else ''}tensor {name!r} not found in checkpoint {ckpt.path}")
    dtype, on_disk = ckpt.dtype(name), tuple(ckpt.shape(name))
    if index is not None:
        on_disk = on_disk[1:]
    if dtype not in dtypes:
        raise CheckpointError(f"tensor {name!r} in {ckpt.path} is {dtype}, expected "
                              f"{' or '.join(str(d) for d in dtypes)}")
    if shape is not None and (len(on_disk) != len(shape) or any(w is not None and w != d
                                                                for w, d in zip(shape, on_disk))):
        want = ", ".join("?" if w is None else str(w) for w in shape)
        raise CheckpointError(f"tensor {name!r} in {ckpt.path} has shape {list(on_disk)}, expected [{want}]")
    return ckpt.read(name, index=index)


def unquantized_or_missing(ckpt: Checkpoint, prefix: str, marker: str) -> None:
    """A module without its quantized tensors: fine (None to the caller) if it has a float `weight`."""
    weight = f"{prefix}.weight"
    if weight in ckpt and ckpt.dtype(weight) in FLOATS:
        return None
    raise CheckpointError(f"module {prefix!r} in {ckpt.path} has neither {marker!r} (quantized) nor a float "
                          f"{weight!r} (tensor {marker!r} not found)")


def divides(group: int, K: int, name: str) -> None:
    if group <= 0 or K % group:
        raise CheckpointError(f"tensor {name!r}: group size {group} does not divide K={K}")


def validated(qw: QuantizedWeight, name: str) -> QuantizedWeight:
    """qw after QuantizedWeight.validate, its ValueError turned into a CheckpointError naming the tensor."""
    try:
        qw.validate(name)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return qw


class Layout:
    """One public on-disk layout of quantized linears. Made from config.json's quantization_config to read
    (`from_config`), or from a format and group size to write (the layout's constructor)."""
    method: ClassVar[str]  # quantization_config.quant_method
    format: QuantFormat

    @classmethod
    def from_config(cls, qc: dict, ckpt: Checkpoint) -> Layout:
        raise NotImplementedError

    def read(self, ckpt: Checkpoint, prefix: str) -> QuantizedWeight | None:
        """The linear at `prefix` [N, K] in the canonical form; None when stored as a float `prefix.weight`."""
        raise NotImplementedError

    def write(self, prefix: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        """The tensors (full names) that store qw [N, K] at `prefix`."""
        raise NotImplementedError

    def config(self, unquantized: list[str]) -> dict:
        """quantization_config for config.json; `unquantized`: the linears (module names) kept in float."""
        raise NotImplementedError

    def accepts(self, N: int, K: int) -> str:
        """'' when a linear [N, K] can be stored; otherwise why not."""
        return ""
