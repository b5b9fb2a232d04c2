"""Worker-score heatmap (DP rank × stage). matplotlib is imported only when drawing."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainscope.whatif.analysis import WhatIf


def score_matrix(result: WhatIf) -> np.ndarray:
    """(stages, dp ranks) matrix of worker scores."""
    stages = 1 + max(w["stage"] for w in result.S_worker)
    dps = 1 + max(w["dp_rank"] for w in result.S_worker)
    matrix = np.full((stages, dps), np.nan)
    for w in result.S_worker:
        matrix[w["stage"], w["dp_rank"]] = w["score"]
    return matrix


def heatmap(result: WhatIf, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matrix = score_matrix(result)
    stages, dps = matrix.shape
    width = min(16.0, 3.0 + dps * 0.35)
    height = min(10.0, 2.0 + stages * 0.45)
    fig, ax = plt.subplots(figsize=(width, height))
    image = ax.imshow(
        matrix,
        aspect="auto",
        cmap="magma_r",
        interpolation="nearest",
        vmin=1.0,
        vmax=max(1.0 + 1e-6, float(np.nanmax(matrix))),
    )
    # Integer ticks: a fractional stage or rank label would be nonsense.
    if stages <= 32:
        ax.set_yticks(range(stages))
    if dps <= 32:
        ax.set_xticks(range(dps))
    ax.set_xlabel("data-parallel rank")
    ax.set_ylabel("pipeline stage")
    ax.set_title(f"What-if worker scores (S = {result.S:.3f})")
    fig.colorbar(image, ax=ax, label="worker score = min(S of its DP rank, S of its stage)")
    path = Path(path)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
