"""Worker-score heatmap (stage × DP rank). matplotlib is imported only when drawing.

The colour scale is fixed (1.0 → 1.5, clipped) and each cell prints its score, so heatmaps of
different jobs read the same way.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from trainscope.whatif.analysis import WhatIf

SCALE = (1.0, 1.5)  # colour scale of worker scores, fixed across jobs
# Beyond this many workers the numbers would not fit in their cells.
MAX_ANNOTATED_CELLS = 1024
MAX_FIGURE_IN = 40.0
MIN_WIDTH_IN = 6.0  # room for the title


def score_matrix(result: WhatIf) -> np.ndarray:
    """(stages, dp ranks) matrix of worker scores."""
    stages = 1 + max(w["stage"] for w in result.S_worker)
    dps = 1 + max(w["dp_rank"] for w in result.S_worker)
    matrix = np.full((stages, dps), np.nan)
    for w in result.S_worker:
        matrix[w["stage"], w["dp_rank"]] = w["score"]
    return matrix


def heatmap(result: WhatIf, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig = figure(result)
    path = Path(path)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def figure(result: WhatIf) -> Any:
    """The heatmap as a matplotlib figure (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matrix = score_matrix(result)
    stages, dps = matrix.shape
    annotate = stages * dps <= MAX_ANNOTATED_CELLS
    cell_in = 0.6 if annotate else 0.35
    width = min(MAX_FIGURE_IN, max(MIN_WIDTH_IN, 3.0 + dps * cell_in))
    height = min(MAX_FIGURE_IN, 2.0 + stages * cell_in * 0.75)
    fig, ax = plt.subplots(figsize=(width, height))
    # A fixed scale, so two heatmaps can be compared by colour: 1.0 (healthy) to 1.5 (very
    # slow); scores beyond are drawn at the end colour and their number says how far.
    image = ax.imshow(
        np.clip(matrix, SCALE[0], SCALE[1]),
        aspect="auto",
        cmap="magma_r",
        interpolation="nearest",
        vmin=SCALE[0],
        vmax=SCALE[1],
    )
    if annotate:
        for s in range(stages):
            for d in range(dps):
                value = matrix[s, d]
                dark = (min(value, SCALE[1]) - SCALE[0]) / (SCALE[1] - SCALE[0]) > 0.5
                ax.text(
                    d,
                    s,
                    f"{value:.2f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white" if dark else "black",
                )
    # Integer ticks: a fractional stage or rank label would be nonsense.
    if stages <= 32:
        ax.set_yticks(range(stages))
    if dps <= 32:
        ax.set_xticks(range(dps))
    ax.set_xlabel("data-parallel rank")
    ax.set_ylabel("pipeline stage")
    ax.set_title(title(result))
    fig.colorbar(image, ax=ax, label="worker score = min(S of its DP rank, S of its stage)")
    return fig


def title(result: WhatIf) -> str:
    return (
        f"What-if worker scores\nS = {result.S:.3f} · M_W = {_share(result.M_W)} · "
        f"M_S = {_share(result.M_S)}"
    )


def _share(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}"
