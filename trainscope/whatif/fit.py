"""Does the trace fit the dependency model? A what-if number is only as good as the replay.

Two checks, both computed by :func:`analysis.analyse`:

- the replay with each op's own launch delay kept must reproduce the observed step times
  (relative error per step and DP rank: median and p90);
- the replay without launch delays can only be faster than what was observed, never slower.

A failed check sets a bit in ``fit`` (0 means the model fits) and adds a warning that travels
with the result (report, ``--json`` ``warnings``, the stored ``whatif_results`` row).
"""

from __future__ import annotations

# Above this median replay error the figures describe the model more than the job.
MAX_SIM_ERROR = 0.05
# A replay without launch delays that is this much slower than observed means dependencies
# the job did not have.
MAX_NODELAY_EXCESS = 0.05
# A send may end before its peer starts (the data is buffered) by this much; beyond that the
# clocks of the two hosts disagree or the pairing is wrong.
EARLY_END_S = 0.010

FIT_SIM_ERROR = 1
FIT_NODELAY_SLOWER = 2


def model_fit(
    error_median: float,
    error_p90: float,
    observed_step_s: float,
    nodelay_step_s: float,
    early_ends: int = 0,
) -> tuple[int, list[str]]:
    """``(fit flags, warnings)`` for one analysis."""
    fit = 0
    warnings: list[str] = []
    if not error_median <= MAX_SIM_ERROR:
        fit |= FIT_SIM_ERROR
        warnings.append(
            f"the trace does not fit the dependency model: replaying it with its own launch "
            f"delays misses the observed step times by {error_median:.1%} (median, p90 "
            f"{error_p90:.1%}; limit {MAX_SIM_ERROR:.0%}), so S, M_W and M_S are unreliable"
        )
    if not nodelay_step_s <= observed_step_s * (1 + MAX_NODELAY_EXCESS):
        fit |= FIT_NODELAY_SLOWER
        warnings.append(
            f"the replay without launch delays ({nodelay_step_s * 1e3:.1f} ms per step) is "
            f"slower than observed ({observed_step_s * 1e3:.1f} ms): the dependency model "
            "has waits the job did not have, so S, M_W and M_S are unreliable"
        )
    if early_ends:
        warnings.append(
            f"{early_ends} communication op(s) ended more than {EARLY_END_S * 1e3:.0f} ms before "
            "a peer started (buffered sends, or host clocks that disagree); their transfer time is "
            "taken as 0"
        )
    return fit, warnings
