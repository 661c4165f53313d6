"""The sweeps' axes and named grids (/work/shared/workloads.md, from the MoE-Inference-Bench paper).

    runtime sweep:      batch x input length x output length (x checkpoints, x experts impl)
    architecture sweep: one hyperparameter changed at a time around a skeleton layer (Mixtral-8x7B by default):
                        FFN dimension I, experts E, top-k, hidden size H; the skeleton point once, not once per axis

The paper sweeps I, E and k around Mixtral-8x7B; it does not sweep the hidden size, so the "paper" grid adds
H = 1024, 2048, 4096, 8192 (powers of two around Mixtral's 4096, the range the presets span: 2048 to 5120).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from cpumoe.presets import LayerPreset

ARCH_AXES = ("inter", "experts", "top_k", "hidden")   # the order the architecture sweep walks them in
DEFAULT_SKELETON = "mixtral-8x7b"


@dataclass(frozen=True, slots=True)
class Grid:
    """A named set of axis values; an axis a grid leaves empty is not swept (the skeleton's value stays)."""
    batch: tuple[int, ...] = ()
    input_len: tuple[int, ...] = ()
    output_len: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()       # M of the layer-level sweep
    inter: tuple[int, ...] = ()
    experts: tuple[int, ...] = ()
    top_k: tuple[int, ...] = ()
    hidden: tuple[int, ...] = ()


_LENGTHS = (128, 256, 512, 1024, 2048)
GRIDS: dict[str, Grid] = {
    # The paper's grids.
    "paper": Grid(batch=(1, 16, 32, 64), input_len=_LENGTHS, output_len=_LENGTHS, tokens=(1, 16, 32, 64),
                  inter=(1792, 3584, 7168, 14336), experts=(8, 16, 32, 64), top_k=(1, 2, 4, 8),
                  hidden=(1024, 2048, 4096, 8192)),
    # A first look in minutes: the paper's end points only.
    "small": Grid(batch=(1, 16), input_len=(128,), output_len=(128,), tokens=(1, 64), inter=(1792, 14336),
                  experts=(8, 16), top_k=(1, 2), hidden=(2048, 4096)),
}


def get_grid(name: str) -> Grid:
    try:
        return GRIDS[name]
    except KeyError:
        raise ValueError(f"unknown grid {name!r}; known: {', '.join(GRIDS)}") from None


@dataclass(frozen=True, slots=True)
class Shape:
    """One MoE layer shape of the architecture sweep. `axis` names the hyperparameter this point varies ("skeleton"
    for the skeleton itself)."""
    hidden: int
    inter: int
    experts: int
    top_k: int
    axis: str = "skeleton"

    def preset(self, skeleton: LayerPreset) -> LayerPreset:
        """The skeleton's routing and activation with this shape (and the skeleton's name: a case is the same case
        whichever axis reached it)."""
        return replace(skeleton, hidden=self.hidden, inter=self.inter, experts=self.experts,
                       top_k=self.top_k,
                       router_weight_on_input=skeleton.router_weight_on_input and self.top_k == 1)


def arch_shapes(skeleton: LayerPreset, axes: dict[str, tuple[int, ...]]) -> list[Shape]:
    """The skeleton, then each axis's values with every other hyperparameter at the skeleton's: a point equal to the
    skeleton (or to an earlier point) is listed once. A top-k above the point's experts is dropped. ValueError for
    an unknown axis or a value below 1."""
    base = Shape(hidden=skeleton.hidden, inter=skeleton.inter, experts=skeleton.experts, top_k=skeleton.top_k)
    shapes, seen = [base], {_dims(base)}
    for axis in ARCH_AXES:
        for value in axes.get(axis, ()):
            if value < 1:
                raise ValueError(f"{axis} must be positive, got {value}")
            shape = replace(base, **{axis: value}, axis=axis)
            if shape.top_k > shape.experts or _dims(shape) in seen:
                continue
            seen.add(_dims(shape))
            shapes.append(shape)
    unknown = set(axes) - set(ARCH_AXES)
    if unknown:
        raise ValueError(f"unknown axis {', '.join(sorted(unknown))}; known: {', '.join(ARCH_AXES)}")
    return shapes


def _dims(shape: Shape) -> tuple[int, int, int, int]:
    return shape.hidden, shape.inter, shape.experts, shape.top_k
