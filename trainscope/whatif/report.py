"""A readable what-if report: what the numbers mean, in words."""

from __future__ import annotations

import math

from trainscope.whatif.analysis import WhatIf

# Above this, a group is worth naming as a contributor to the slowdown.
NOTABLE_EXCESS = 0.02
# A characterisation share above this is called "most of" the slowdown.
DOMINANT_SHARE = 0.5


def render(result: WhatIf, top: int = 5) -> str:
    lines: list[str] = []
    lines.append(
        f"Analysed {result.steps} step(s) of {result.workers} worker(s) "
        f"(one per data-parallel rank × pipeline stage)."
    )
    if result.steps_dropped:
        lines.append(
            f"Dropped {len(result.steps_dropped)} incomplete step(s): "
            + ", ".join(map(str, result.steps_dropped[:10]))
            + (" …" if len(result.steps_dropped) > 10 else "")
        )
    lines.append("")
    lines.append(
        f"Straggler slowdown S = {result.S:.3f}: the job ran {result.S:.2f}× slower than the ideal "
        f"run where every op takes its typical time "
        f"(mean step {result.step_time_nodelay_s * 1e3:.1f} ms without launch delays, ideal "
        f"{result.step_time_ideal_s * 1e3:.1f} ms; observed "
        f"{result.step_time_real_s * 1e3:.1f} ms)."
    )
    if result.S - 1.0 < NOTABLE_EXCESS:
        lines.append("That is within noise: no straggler worth chasing.")
    lines.append(_characterisation(result))
    lines.append("")
    lines.append("Slowdown if only this group ran at its real durations (the rest ideal):")
    lines.append("  op types: " + _top_items(result.S_optype, top))
    lines.append(
        "  stages:   " + _top_items({f"stage {k}": v for k, v in result.S_stage.items()}, top)
    )
    lines.append(
        "  DP ranks: " + _top_items({f"dp {k}": v for k, v in result.S_dp_rank.items()}, top)
    )
    lines.append("Most suspect workers (score = min of their DP rank's and stage's S):")
    for w in result.S_worker[:top]:
        lines.append(f"  dp_rank {w['dp_rank']:>5}  stage {w['stage']:>3}  score {w['score']:.3f}")
    lines.append("")
    lines.append(
        f"Simulation error (replay with launch delays vs observed step time): median "
        f"{result.sim_error_median:.2%}, p90 {result.sim_error_p90:.2%}."
    )
    for warning in result.warnings[:5]:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def _characterisation(result: WhatIf) -> str:
    if math.isnan(result.M_W) or math.isnan(result.M_S):
        return "There is no slowdown over the ideal run to attribute."
    n_top = len(result.top_workers)
    who = "the slowest worker" if n_top == 1 else f"the {n_top} slowest workers (top 3%)"
    text = (
        f"{_pct(result.M_W)} of the excess over ideal is removed by fixing {who}; "
        f"{_pct(result.M_S)} by fixing the last pipeline stage."
    )
    if result.M_W >= DOMINANT_SHARE and result.M_W >= result.M_S:
        return text + " Individual slow workers are the main cause."
    if result.M_S >= DOMINANT_SHARE:
        return text + (
            " Stage partitioning imbalance is the main cause (the last stage has too much work)."
        )
    return text + (
        " The slowdown is spread out: neither a few workers nor the last stage explain most of it."
    )


def _pct(x: float) -> str:
    return f"{max(min(x, 9.99), -9.99):.0%}"


def _top_items(values: dict, top: int) -> str:
    items = sorted(values.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{k} {v:.3f}" for k, v in items) or "-"
