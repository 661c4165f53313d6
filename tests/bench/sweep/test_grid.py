"""The sweep's axes: one hyperparameter at a time around the skeleton, the skeleton once, the named grids."""
import pytest

from cpumoe.bench.sweep.grid import GRIDS, Shape, arch_shapes, get_grid
from cpumoe.presets import get_preset


def dims(s: Shape) -> tuple[int, int, int, int]:
    return s.hidden, s.inter, s.experts, s.top_k


def test_paper_grid_around_mixtral_lists_the_skeleton_once():
    g = get_grid("paper")
    shapes = arch_shapes(get_preset("mixtral-8x7b"), dict(inter=g.inter, experts=g.experts, top_k=g.top_k,
                                                           hidden=g.hidden))
    assert dims(shapes[0]) == (4096, 14336, 8, 2) and shapes[0].axis == "skeleton"
    # 4 values per axis, each axis holding the skeleton's own value once: 1 + 4 x 3 points
    assert len(shapes) == 13 and len({dims(s) for s in shapes}) == 13
    for s in shapes[1:]:
        changed = [a for a, v, base in zip(("hidden", "inter", "experts", "top_k"), dims(s), (4096, 14336, 8, 2))
                   if v != base]
        assert changed == [s.axis], s   # exactly the one hyperparameter the point belongs to
    assert sorted(s.experts for s in shapes if s.axis == "experts") == [16, 32, 64]
    assert sorted(s.hidden for s in shapes if s.axis == "hidden") == [1024, 2048, 8192]


def test_tiny_axes_drop_duplicates_and_top_k_above_experts():
    skeleton = get_preset("qwen3-30b-a3b")
    shapes = arch_shapes(skeleton, dict(inter=(768, 32), experts=(4, 128), top_k=(8, 2)))
    assert [dims(s) for s in shapes] == [(2048, 768, 128, 8), (2048, 32, 128, 8), (2048, 768, 128, 2)]
    # E=4 < k=8 is not a layer: dropped; E=128, I=768, k=8 are the skeleton again: not repeated


def test_preset_keeps_the_skeleton_name_and_routing():
    skeleton = get_preset("llama-4-scout-17b-16e")
    p = Shape(hidden=64, inter=32, experts=4, top_k=2, axis="top_k").preset(skeleton)
    assert (p.name, p.hidden, p.inter, p.experts, p.top_k) == (skeleton.name, 64, 32, 4, 2)
    assert p.scoring == skeleton.scoring and not p.router_weight_on_input   # only defined for k = 1


def test_bad_axes():
    skeleton = get_preset("mixtral-8x7b")
    with pytest.raises(ValueError, match="inter must be positive"):
        arch_shapes(skeleton, dict(inter=(0,)))
    with pytest.raises(ValueError, match="unknown axis vocab"):
        arch_shapes(skeleton, dict(vocab=(8,)))
    with pytest.raises(ValueError, match="unknown grid 'nope'; known: paper, small"):
        get_grid("nope")
    assert set(GRIDS) == {"paper", "small"}
