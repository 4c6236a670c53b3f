"""Layers x steps heat map of a per-layer routing statistic, for TensorBoard images.

    img_HWC = heatmap_image(flip_history_SL, title="top-k flip rate", steps=steps)
    writer.add_image("routing/flip_rate_heatmap", img_HWC, step, dataformats="HWC")

Drawn on a bare `matplotlib.figure.Figure` with the Agg canvas: no pyplot, so no global
figure registry, no backend selection, and safe to call from a training process.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _as_history(history_SL: torch.Tensor | np.ndarray | Sequence[Sequence[float]]) -> np.ndarray:
    if isinstance(history_SL, torch.Tensor):
        arr = history_SL.detach().float().cpu().numpy()
    else:
        arr = np.asarray(history_SL, dtype=np.float32)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(
            f"history_SL must be a non-empty 2-D [steps, L] array, got shape {arr.shape}"
        )
    return arr


def heatmap_figure(
    history_SL: torch.Tensor | np.ndarray | Sequence[Sequence[float]],
    *,
    title: str = "",
    stat_label: str = "",
    steps: Sequence[int] | None = None,
    vmin: float | None = None,
    vmax: float | None = None,
    size_in: tuple[float, float] = (6.4, 3.6),
    dpi: int = 100,
) -> Figure:
    """Figure with MoE layer on y, training step on x, and a colour bar labelled `stat_label`.

    history_SL: [steps, L], row s = the statistic's per-layer vector at step `steps[s]`
    (default 0..S-1). NaN cells (a layer not measured that step) are drawn blank.
    """
    arr_SL = _as_history(history_SL)
    S, L = arr_SL.shape
    steps_S = np.arange(S) if steps is None else np.asarray(steps)
    if steps_S.shape != (S,):
        raise ValueError(f"steps must have one entry per history row ({S}), got {steps_S.shape}")

    fig = Figure(figsize=size_in, dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    # cell edges halfway between steps, so uneven logging intervals still line up
    if S > 1:
        mid = (steps_S[1:] + steps_S[:-1]) / 2.0
        x_edges = np.concatenate([[2 * steps_S[0] - mid[0]], mid, [2 * steps_S[-1] - mid[-1]]])
    else:
        x_edges = np.array([steps_S[0] - 0.5, steps_S[0] + 0.5])
    y_edges = np.arange(L + 1) - 0.5
    mesh = ax.pcolormesh(
        x_edges, y_edges, np.ma.masked_invalid(arr_SL.T), cmap="viridis", vmin=vmin, vmax=vmax
    )
    ax.set_xlabel("training step")
    ax.set_ylabel("MoE layer")
    ax.set_ylim(L - 0.5, -0.5)  # layer 0 on top, as a reader scans a network
    if L <= 16:
        ax.set_yticks(range(L))
    if title:
        ax.set_title(title)
    cbar = fig.colorbar(mesh, ax=ax)
    cbar.set_label(stat_label or title)
    fig.tight_layout()
    return fig


def figure_to_image(fig: Figure) -> np.ndarray:
    """Render a figure to an [H, W, 3] uint8 array (TensorBoard's dataformats="HWC")."""
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def heatmap_image(
    history_SL: torch.Tensor | np.ndarray | Sequence[Sequence[float]], **kwargs
) -> np.ndarray:
    """`heatmap_figure(...)` rendered to an [H, W, 3] uint8 image; kwargs as there."""
    return figure_to_image(heatmap_figure(history_SL, **kwargs))
