"""The layer x expert heatmap of routing counts, as a PNG (matplotlib, Agg backend: no display needed).

Each cell is the share of the layer's routed tokens that chose the expert, in percent (each row sums to 100),
so layers of a long and a short run read alike; the colour bar says the scale. The figure grows with the grid
(about 0.12 inch per expert and 0.25 per layer, within readable bounds) and the tick labels thin out so that
4..64 layers and 8..128 experts stay legible.
"""
from __future__ import annotations

from pathlib import Path

import torch


def _ticks(n: int, most: int) -> list[int]:
    step = max(1, -(-n // most))
    return list(range(0, n, step))


def draw_heatmap(counts: torch.Tensor, layers: list[int], out: str | Path, *, title: str) -> Path:
    """counts [L, E] (tokens per MoE layer and expert), `layers`: their decoder layer indices -> the PNG at `out`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, E = counts.shape
    share = 100.0 * counts.double() / counts.sum(dim=1, keepdim=True).clamp(min=1)  # [L, E] percent of the layer
    width = min(24.0, max(6.0, 2.5 + 0.12 * E))
    height = min(18.0, max(3.0, 1.5 + 0.25 * L))
    fig, ax = plt.subplots(figsize=(width, height), dpi=100)
    image = ax.imshow(share.numpy(), aspect="auto", interpolation="nearest", cmap="viridis")
    bar = fig.colorbar(image, ax=ax)
    bar.set_label("share of the layer's routed tokens (%)")
    xt, yt = _ticks(E, 32), _ticks(L, 32)
    ax.set_xticks(xt, [str(e) for e in xt], fontsize=7 if E > 32 else 8)
    ax.set_yticks(yt, [str(layers[i]) for i in yt], fontsize=7 if L > 32 else 8)
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    out = Path(out)
    if out.parent != Path(""):
        out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out
