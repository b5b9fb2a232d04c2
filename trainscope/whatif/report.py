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
    if result.warnings:
        lines.append("")
        lines.extend(f"warning: {w}" for w in result.warnings[:5])
        if len(result.warnings) > 5:
            lines.append(f"… and {len(result.warnings) - 5} more warning(s) (see --json)")
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
    verdict = "fits" if result.fit == 0 else "does NOT fit (see the warnings above)"
    lines.append(
        f"Model fit: the trace {verdict} the dependency model. Replaying it with its own "
        f"launch delays misses the observed step times by {result.sim_error_median:.2%} "
        f"(median), {result.sim_error_p90:.2%} (p90). Without launch delays a step takes "
        f"{result.step_time_nodelay_s * 1e3:.1f} ms against {result.step_time_real_s * 1e3:.1f} "
        f"ms observed: CPU-side launch delays cost {_pct(_launch_share(result))} of the "
        "observed step time."
    )
    return "\n".join(lines)


def _launch_share(result: WhatIf) -> float:
    if result.step_time_real_s <= 0:
        return math.nan
    return 1.0 - result.step_time_nodelay_s / result.step_time_real_s


def _characterisation(result: WhatIf) -> str:
    if math.isnan(result.M_W) or math.isnan(result.M_S):
        return "There is no slowdown over the ideal run to attribute."
    n_top = len(result.top_workers)
    who = "the slowest worker" if n_top == 1 else f"the {n_top} slowest workers (top 3%)"
    # One pipeline stage: the last stage is the whole job, so M_S is 100% by construction and
    # says nothing about partitioning; it is left out of the verdict.
    one_stage = len(result.S_stage) <= 1
    last_stage_share = 0.0 if one_stage else result.M_S
    stages = ("the job has one pipeline stage, so there is no stage imbalance to weigh"
              if one_stage else f"fixing the last pipeline stage removes {_pct(result.M_S)} (M_S)")
    text = f"Fixing {who} removes {_pct(result.M_W)} of the excess over ideal (M_W); {stages}."
    if last_stage_share > 1.0 or result.M_W > 1.0:
        text += (
            " Over 100% means fixing it alone beats the ideal run, whose typical durations "
            "average the slow ops in."
        )
    if result.M_W >= DOMINANT_SHARE and last_stage_share <= result.M_W:
        return text + " Individual slow workers are the main cause."
    if last_stage_share >= DOMINANT_SHARE:
        return text + (
            " Stage partitioning imbalance is the main cause (the last stage has too much work)."
        )
    explain = "a few workers do not" if one_stage else "neither a few workers nor the last stage"
    return text + f" The slowdown is spread out: {explain} explain most of it."


def _pct(x: float) -> str:
    if math.isnan(x):
        return "n/a"
    text = f"{max(min(x, 9.99), -9.99):.0%}"
    return "0%" if text == "-0%" else text


def _top_items(values: dict, top: int) -> str:
    items = sorted(values.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{k} {v:.3f}" for k, v in items) or "-"
