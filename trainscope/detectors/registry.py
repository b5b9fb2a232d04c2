"""Detectors found through the ``trainscope.detectors`` entry-point group.

A third-party package declares::

    [project.entry-points."trainscope.detectors"]
    my-detector = "my_package.module:MyDetector"

and the registry loads it by name. A plugin that fails to import, to construct, or raises while
detecting is reported once and isolated; it never stops the pipeline. The runner gives every job
its own deep copy of each detector, so a plugin keeps per-job state without knowing about jobs.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points

from trainscope.config.extras import MODULE_EXTRAS
from trainscope.detectors.base import Detector
from trainscope.detectors.budget import OverBudget, time_budget
from trainscope.detectors.contract import ContractViolation, check_contract, contract_windows
from trainscope.detectors.explain import fold_explained
from trainscope.detectors.features import always_on_view, device_clock_view
from trainscope.detectors.own_cost import Alerted, alerted, fold_own_cost, profile_busy_s
from trainscope.schemas.errors import TrainscopeError
from trainscope.schemas.records import Finding
from trainscope.schemas.window import WindowView

GROUP = "trainscope.detectors"
log = logging.getLogger(__name__)


class UnknownDetector(LookupError, TrainscopeError):
    pass


def available(group: str = GROUP) -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=group)}


def is_builtin(entry_point: EntryPoint) -> bool:
    """Whether the entry point names one of trainscope's own detectors."""
    return entry_point.value.split(":")[0].split(".")[0] == "trainscope"


@dataclass
class LoadResult:
    detectors: list[Detector] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


def load(
    names: Iterable[str] | None = None, group: str = GROUP, check_plugins: bool = True
) -> LoadResult:
    """Instantiate the named detectors (all registered ones when ``names`` is None).

    An unknown name is a loud error (a typo must not silently disable detection); a plugin
    that is registered but broken is recorded in ``errors`` and skipped. With ``check_plugins``
    every plugin (a detector from outside trainscope) must also pass the detector contract on
    a few small synthetic windows first (:mod:`trainscope.detectors.contract`): one that does
    not pickle, is not deterministic or mutates its input would break checkpoints or other
    detectors' findings later, far from its cause. The built-ins pass it in trainscope's tests.
    """
    registered = available(group)
    wanted = list(registered) if names is None else list(names)
    unknown = [n for n in wanted if n not in registered]
    if unknown:
        raise UnknownDetector(
            f"unknown detector(s) {', '.join(unknown)}; registered: {', '.join(sorted(registered))}"
        )
    result = LoadResult()
    windows: list[WindowView] | None = None
    for name in wanted:
        try:
            factory = registered[name].load()
            missing = _missing_package(registered[name], factory)
            if missing is not None:
                # Not a bug: an optional package is not installed. The caller shows this one
                # line (the engine logs it, `trainscope detectors` prints it), so no traceback
                # or per-window "raised and is isolated" later, when the model is first built.
                result.errors[name] = missing
                log.debug("detector %s not loaded: %s", name, missing)
                continue
            detector = factory()
        except ModuleNotFoundError as exc:  # a module that imports the package at its top
            needs = exc.name.partition(".")[0] if exc.name else ""
            if not needs or needs == "trainscope":
                result.errors[name] = f"{type(exc).__name__}: {exc}"
                log.warning("detector plugin %s failed to load and is skipped: %s", name, exc)
            else:
                result.errors[name] = _install_line(needs)
                log.debug("detector %s not loaded: %s", name, result.errors[name])
            continue
        except Exception as exc:  # a plugin's bug must not take the pipeline down
            result.errors[name] = f"{type(exc).__name__}: {exc}"
            log.warning("detector plugin %s failed to load and is skipped: %s", name, exc)
            continue
        if not isinstance(detector, Detector):
            result.errors[name] = f"{factory!r} does not implement Detector (name, detect)"
            log.warning("detector plugin %s is not a Detector and is skipped", name)
            continue
        if check_plugins and not is_builtin(registered[name]):
            if windows is None:
                windows = contract_windows()
            try:
                check_contract(factory, windows)
            except Exception as exc:  # a contract violation, or the plugin raising in it
                reason = str(exc) if isinstance(exc, ContractViolation) \
                    else f"{type(exc).__name__}: {exc}"
                result.errors[name] = f"fails the detector contract: {reason}"
                log.warning("detector plugin %s fails the detector contract and is skipped: %s",
                            name, reason)
                continue
        result.detectors.append(detector)
    return result


# Packages a built-in detector imports only when it first builds its model, so loading its
# module succeeds without them; a plugin may say the same with a ``requires`` class attribute.
BUILTIN_REQUIRES: dict[str, tuple[str, ...]] = {
    "trainscope.detectors.multivariate": ("river",),
}
# The extra that installs a detector's package: the stream job is what runs detectors.
DETECTOR_EXTRA = "stream"


def _install_line(module: str) -> str:
    """``needs river: pip install 'trainscope[stream]'``, or ``pip install NAME`` for a package
    no extra of trainscope installs."""
    extras = MODULE_EXTRAS.get(module, ())
    if not extras:
        return f"needs {module}, which is not installed: pip install {module}"
    extra = DETECTOR_EXTRA if DETECTOR_EXTRA in extras else extras[0]
    return f"needs {module}, which is not installed: pip install 'trainscope[{extra}]'"


def _missing_package(entry_point: EntryPoint, factory: object) -> str | None:
    """The one line for the first package the detector needs that is not installed, if any."""
    declared = getattr(factory, "requires", ())
    needs = [*BUILTIN_REQUIRES.get(entry_point.module, ()),
             *((declared,) if isinstance(declared, str) else tuple(declared))]
    for module in needs:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a finder that refuses the name outright
            found = False
        if not found:
            return _install_line(module)
    return None


DEFAULT_MAX_JOBS = 256
# Windows of alerts a job's runner remembers: a fault alerted in any of them before a profile
# is no cost of the profile (a detector may hold it below the alert threshold for a window).
# Windows in which a profile ran do not count: a profile condensed on a contended core can
# last five windows (fault matrix case (c)), and the fault it was asked for must outlast it.
REMEMBERED_WINDOWS = 3


@dataclass
class DetectorRunner:
    """Runs detectors on each window, one set of instances per job, isolating failures.

    ``detectors`` are templates: the first window of a job gets deep copies of them, made
    before any of them has seen a window, so no job's history, model or streak ever reaches
    another job's findings (the river habit of cloning a fresh estimator per key). At most
    ``max_jobs`` jobs keep state; the least recently seen one is forgotten beyond that, and
    counted in ``evicted_jobs``.
    """

    detectors: list[Detector]
    on_error: Callable[[str, Exception], None] | None = None
    errors: dict[str, int] = field(default_factory=dict)
    findings_emitted: int = 0
    max_jobs: int = DEFAULT_MAX_JOBS
    evicted_jobs: int = 0
    # Seconds each detector spent in detect(), over all windows (exported at /metrics).
    detect_seconds: dict[str, float] = field(default_factory=dict)
    # detect() calls stopped over their time budget, per detector (run(budget_s=...)).
    over_budget: dict[str, int] = field(default_factory=dict)
    _templates: list[Detector] = field(init=False, repr=False)
    _jobs: OrderedDict[str, list[Detector]] = field(init=False, repr=False)
    # Each job's alerts of its last windows, newest last (own_cost: a fault alerted before a
    # profile stays an alert through it).
    _alerted: dict[str, tuple[Alerted, ...]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {self.max_jobs}")
        # Copied now, so a caller that keeps using its instances cannot seed a new job's state.
        self._templates = [copy.deepcopy(d) for d in self.detectors]
        self._jobs = OrderedDict()
        self._alerted = {}

    def for_job(self, job_id: str) -> list[Detector]:
        """The job's own detector instances (created on first use)."""
        instances = self._jobs.get(job_id)
        if instances is None:
            instances = self._jobs[job_id] = [copy.deepcopy(d) for d in self._templates]
            while len(self._jobs) > self.max_jobs:
                evicted, _ = self._jobs.popitem(last=False)
                self._alerted.pop(evicted, None)
                self.evicted_jobs += 1
                log.warning("detector state of job %s evicted: more than %d jobs (%d evicted "
                            "so far)", evicted, self.max_jobs, self.evicted_jobs)
        else:
            self._jobs.move_to_end(job_id)
        return instances

    def __setstate__(self, state: dict) -> None:
        # A checkpoint written before detect_seconds existed restores with it empty.
        self.__dict__.update({"detect_seconds": {}, "over_budget": {}, "_alerted": {}, **state})

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)
        self._alerted.pop(job_id, None)

    def jobs(self) -> list[str]:
        return list(self._jobs)

    def run(self, window: WindowView, budget_s: float | None = None) -> list[Finding]:
        """Every detector of the window's job on it. With ``budget_s``, a detector still in
        ``detect()`` after that long is stopped (:mod:`trainscope.detectors.budget`), its
        findings of this window dropped, counted in ``over_budget``, and the job's instance
        replaced by a fresh copy of the template: state half-updated when the timer fired
        cannot be trusted, and copying every detector's state before every call, to be able
        to roll it back, would cost as much as the state (a history of windows) on every
        window of every job, for a rare event. The job's detector starts over (warm-up)."""
        findings: list[Finding] = []
        window = device_clock_view(always_on_view(window))
        instances = self.for_job(window.job_id)
        for i, detector in enumerate(instances):
            started = time.perf_counter()
            try:
                with time_budget(budget_s or 0.0):
                    found = detector.detect(window)
                findings.extend(found)
            except OverBudget:
                self._over_budget(window, i, detector, budget_s or 0.0)
            except Exception as exc:
                first = detector.name not in self.errors
                self.errors[detector.name] = self.errors.get(detector.name, 0) + 1
                if first:
                    log.warning("detector %s raised and is isolated: %r", detector.name, exc)
                if self.on_error is not None:
                    self.on_error(detector.name, exc)
            finally:
                spent_s = time.perf_counter() - started
                self.detect_seconds[detector.name] = (
                    self.detect_seconds.get(detector.name, 0.0) + spent_s
                )
        # Our own profile's cost first: what it explains must not explain other findings away
        # (rank 2's host time folded into a compute alert that the profile itself caused).
        before = self._alerted.get(window.job_id, ())
        busy_s = profile_busy_s(window)
        findings = fold_own_cost(findings, busy_s, frozenset().union(*before))
        if busy_s and before:  # a profile's window joins the last one remembered
            self._alerted[window.job_id] = (*before[:-1], before[-1] | alerted(findings))
        else:
            self._alerted[window.job_id] = (*before, alerted(findings))[-REMEMBERED_WINDOWS:]
        findings = fold_explained(findings)
        self.findings_emitted += len(findings)
        return findings

    def _over_budget(self, window: WindowView, index: int, detector: Detector,
                     budget_s: float) -> None:
        count = self.over_budget[detector.name] = self.over_budget.get(detector.name, 0) + 1
        # Once per detector, then every 100th: a flood of costly windows must not flood the log.
        level = logging.WARNING if count % 100 == 1 else logging.DEBUG
        log.log(level, "detector %s skipped on job %s window %d: over its %g s budget "
                "(--detector-budget-s; %d time(s) so far); its state for the job starts over",
                detector.name, window.job_id, window.window_start_ns, budget_s, count)
        instances = self._jobs.get(window.job_id)
        if instances is not None:
            instances[index] = copy.deepcopy(self._templates[index])
