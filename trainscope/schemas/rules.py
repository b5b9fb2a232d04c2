"""Validation rules written once: the words a record kind's rules are declared in, and the two
checks derived from each declaration.

A :class:`Kind` lists the rules of one record kind (``RULES`` in :mod:`.validate`): ``fields``
test the record's own values, ``groups`` each row of its parallel lists (or each item of a list
of structs), ``columns`` each element of its packed numpy columns. A rule says which value,
which bounds, and the reason text. :class:`Checks` derives from it, for one set of limits:

- the **fast** check: every field and group rule rendered as Python source and joined into one
  ``and`` expression, compiled once, which costs what a hand-written ``lo <= r.x <= hi and ...``
  costs (the stream job calls it for every row record); a list group is tested with ``min`` and
  ``max`` over each list, and columns with a few numpy reductions over a whole poll's batches
  joined together;
- the **explaining** check: the same rendered tests, compiled one by one and tried in order
  until one fails; its operands (value, bounds) make the one-line reason. A column is searched
  with a numpy mask for its first bad element.

Both are rendered from the same rule, so a bound cannot be changed in one and not the other;
``tests/schemas/test_validate_agreement.py`` checks that the verdicts agree.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from functools import cached_property, partial
from typing import Any

import numpy as np

I16_MIN, I16_MAX = -(2**15), 2**15 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
U32_MAX = 2**32 - 1
I64_MAX = 2**63 - 1
U64_MAX = 2**64 - 1


# -- bounds ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limit:
    """A field of the validator's ``Limits``, less ``minus`` (the last device is
    ``max_devices - 1``)."""

    name: str
    minus: int = 0


@dataclass(frozen=True)
class Ref:
    """Another value of the same record, less ``minus`` (a worker's ``dp_rank`` is at most the
    topology's ``dp_size - 1``)."""

    name: str
    minus: int = 0


@dataclass(frozen=True)
class Row:
    """Another value of the same row of a group (a call path's ``self_ns`` is at most its own
    ``total_ns``)."""

    name: str


class Context(Enum):
    """Bounds known only when a message is checked."""

    # The job's world size - 1; before its topology is known, Limits.max_ranks - 1.
    LAST_RANK = "last_rank"
    # Now plus Limits.max_future_ns, read once per poll.
    LATEST_NS = "latest_ns"


LAST_RANK = Context.LAST_RANK
LATEST_NS = Context.LATEST_NS

Bound = int | float | Limit | Ref | Row | Context | None


# -- what a rule tests ----------------------------------------------------------------------


@dataclass(frozen=True)
class Len:
    """The length of a field (a batch's number of functions)."""

    field: str


@dataclass(frozen=True)
class Diff:
    """``end - start`` of two fields, under its own name (a window's length)."""

    name: str
    end: str
    start: str


@dataclass(frozen=True)
class Gaps:
    """A column's consecutive differences (each row's sketch entries, from the offsets).

    Over a poll's joined columns the difference across two batches is <= 0, never a row's, so
    only an upper bound may be put on it."""

    field: str
    name: str


Subject = str | Len | Diff | Gaps


def _name(subject: Subject) -> str:
    if isinstance(subject, str):
        return subject
    return subject.field if isinstance(subject, Len) else subject.name


@dataclass(frozen=True)
class _Scope:
    """How a rule's source spells its values: the record is ``r``, a row's value is what
    ``value`` makes of its name; limits are baked in as literals."""

    limits: Any
    value: Callable[[str], str]

    def subject(self, subject: Subject) -> str:
        if isinstance(subject, str):
            return self.value(subject)
        if isinstance(subject, Len):
            return f"len({self.value(subject.field)})"
        if isinstance(subject, Diff):
            return f"({self.value(subject.end)} - {self.value(subject.start)})"
        raise TypeError(f"{subject} applies to numpy columns only")

    def bound(self, bound: Bound) -> str:
        if bound is None or isinstance(bound, int):
            return repr(bound)
        if isinstance(bound, float):
            return repr(bound) if math.isfinite(bound) else ("_INF" if bound > 0 else "-_INF")
        if isinstance(bound, Limit):
            return repr(getattr(self.limits, bound.name) - bound.minus)
        if isinstance(bound, Ref):
            return f"(r.{bound.name} - {bound.minus})" if bound.minus else f"r.{bound.name}"
        if isinstance(bound, Row):
            return self.value(bound.name)
        if bound is LAST_RANK:
            return (f"((declared.get(r.job_id) or world.get(r.job_id) or "
                    f"{self.limits.max_ranks}) - 1)")
        return "latest_ns"


def _op(bound: Bound) -> str:
    """``<=``, or ``<`` against an infinite bound: then NaN and the infinities fail the same
    test that bounds a finite value, with no ``isfinite`` call."""
    return "<" if isinstance(bound, float) and math.isinf(bound) else "<="


_OPS = {"<": operator.lt, "<=": operator.le}


# -- rules ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Int:
    """``lo <= value <= hi``; a ``None`` side is unbounded. ``reason`` may name ``name``,
    ``value``, ``lo``, ``hi``, ``why`` (why a rank bound is what it is), the record ``r`` and a
    column's index ``i``."""

    field: Subject
    lo: Bound
    hi: Bound
    reason: str = "{name}={value} not in [{lo}, {hi}]{why}"

    @property
    def name(self) -> str:
        return _name(self.field)

    def test(self, s: _Scope) -> str:
        x = s.subject(self.field)
        low = "" if self.lo is None else f"{s.bound(self.lo)} {_op(self.lo)} "
        high = "" if self.hi is None else f" {_op(self.hi)} {s.bound(self.hi)}"
        return f"{low}{x}{high}" if low or high else "True"

    def operands(self, s: _Scope) -> str:
        return f"({s.subject(self.field)}, {s.bound(self.lo)}, {s.bound(self.hi)})"

    def list_test(self, s: _Scope) -> str:
        """The test of every element of a list: its min and max against a bound of the record,
        element by element against a bound of the row."""
        values = s.value(self._element)
        tests = []
        for bound, low in ((self.lo, True), (self.hi, False)):
            if bound is None:
                continue
            op = _op(bound)
            if isinstance(bound, Row):
                pair = (s.bound(bound), values) if low else (values, s.bound(bound))
                tests.append(f"all(map(_OPS[{op!r}], {pair[0]}, {pair[1]}))")
            elif low:
                tests.append(f"{s.bound(bound)} {op} min({values})")
            else:
                tests.append(f"max({values}) {op} {s.bound(bound)}")
        return f"(not {values} or ({' and '.join(tests) or 'True'}))"

    @property
    def _element(self) -> str:
        if not isinstance(self.field, str):
            raise TypeError(f"a rule on {self.field} cannot apply to each element of a list")
        return self.field

    def describe(self, at: str, operands: tuple[Any, ...], why: str, r: object, i: int) -> str:
        value, lo, hi = operands
        return self.reason.format(name=f"{self.name}{at}", value=_short(value), lo=lo, hi=hi,
                                  why=why, r=r, i=i)

    # numpy columns

    @property
    def columns(self) -> tuple[str, ...]:
        return (self.field.field,) if isinstance(self.field, Gaps) else (self._element,)

    def values(self, column: Callable[[str], np.ndarray]) -> np.ndarray:
        if isinstance(self.field, Gaps):
            return np.diff(column(self.field.field))
        return column(self._element)

    def column_ok(self, column: Callable[[str], np.ndarray], lo: Any, hi: Any) -> bool:
        """Whole columns at once: a reduction per bound (a comparison per element where the
        bound is per element: the ranks of batches of jobs of different sizes)."""
        x = self.values(column)
        if not len(x):
            return True
        if lo is not None:
            op = _OPS[_op(lo)]
            if not (op(lo, x.min()) if np.ndim(lo) == 0 else op(lo, x).all()):
                return False
        if hi is not None:
            op = _OPS[_op(hi)]
            if not (op(x.max(), hi) if np.ndim(hi) == 0 else op(x, hi).all()):
                return False
        return True

    def column_bad(self, column: Callable[[str], np.ndarray], lo: Any, hi: Any) -> np.ndarray:
        x = self.values(column)
        bad = np.zeros(len(x), dtype=bool)
        if lo is not None:
            bad |= ~_OPS[_op(lo)](lo, x)
        if hi is not None:
            bad |= ~_OPS[_op(hi)](x, hi)
        return bad

    def column_operands(self, column: Callable[[str], np.ndarray], i: int, lo: Any, hi: Any
                        ) -> tuple[Any, ...]:
        return (self.values(column)[i].item(), lo, hi)


@dataclass(frozen=True)
class Number(Int):
    """A finite number in ``[lo, hi]``; an infinite bound is strict, so NaN and the
    infinities fail the same comparisons."""

    lo: float = -math.inf
    hi: float = math.inf
    reason: str = "{name}={value} is not a finite number in [{lo}, {hi}]"

    def list_test(self, s: _Scope) -> str:
        raise TypeError("no list of numbers is checked element by element yet")


@dataclass(frozen=True)
class Text(Int):
    """A string of ``lo`` (0 or 1: may it be empty?) to ``hi`` characters."""

    field: str

    def test(self, s: _Scope) -> str:
        low = f"{self.lo} <= " if self.lo else ""
        return f"{low}len({s.value(self.field)}) <= {s.bound(self.hi)}"

    def operands(self, s: _Scope) -> str:
        return f"({s.value(self.field)}, {self.lo}, {s.bound(self.hi)})"

    def list_test(self, s: _Scope) -> str:
        values = s.value(self.field)
        low = f"{self.lo} <= min(map(len, {values})) and " if self.lo else ""
        return f"(not {values} or ({low}max(map(len, {values})) <= {s.bound(self.hi)}))"

    def describe(self, at: str, operands: tuple[Any, ...], why: str, r: object, i: int) -> str:
        text, _, hi = operands
        if not text and self.lo:
            return f"{self.name}{at} is empty"
        return (f"{self.name}{at} has {len(text)} characters, more than {hi} "
                f"(starts {_short(text[:20])})")


@dataclass(frozen=True)
class Ordered:
    """``low <= high`` wherever ``when`` > 0 (a summary of no executions has no min or max)."""

    low: str
    high: str
    when: str

    @property
    def name(self) -> str:
        return self.low

    def test(self, s: _Scope) -> str:
        return f"({s.value(self.when)} <= 0 or {s.value(self.low)} <= {s.value(self.high)})"

    def operands(self, s: _Scope) -> str:
        return f"({s.value(self.low)}, {s.value(self.high)}, None)"

    def list_test(self, s: _Scope) -> str:
        raise TypeError("Ordered applies to record fields and numpy columns")

    def describe(self, at: str, operands: tuple[Any, ...], why: str, r: object, i: int) -> str:
        low, high, _ = operands
        return f"{self.low}{at}={low} is above {self.high}{at}={high}"

    @property
    def columns(self) -> tuple[str, ...]:
        return (self.when, self.low, self.high)

    def column_ok(self, column: Callable[[str], np.ndarray], lo: Any, hi: Any) -> bool:
        return not self.column_bad(column, lo, hi).any()

    def column_bad(self, column: Callable[[str], np.ndarray], lo: Any, hi: Any) -> np.ndarray:
        return (column(self.when) > 0) & (column(self.low) > column(self.high))

    def column_operands(self, column: Callable[[str], np.ndarray], i: int, lo: Any, hi: Any
                        ) -> tuple[Any, ...]:
        return (column(self.low)[i].item(), column(self.high)[i].item(), None)


Rule = Int | Ordered


@dataclass(frozen=True)
class Group:
    """Rules for each row of a record's parallel lists, or each item of its list of structs.

    ``lists`` pairs each row value's name with the record's list holding it; a single string
    names a list of structs, whose attributes are the row values. A failing row is named
    ``label`` (formatted with its index ``i``) before the reason; without a label the value
    itself carries the index (``sketch_counts[3]=-1 not in ...``).

    ``memo``: the fast check remembers the lists it passed (a bounded set), for lists that
    repeat message after message: a rank sends the same function dictionary every window.
    Only for rules whose bounds are fixed by the limits (the lists are the whole key).
    """

    label: str | None
    lists: tuple[tuple[str, str], ...] | str
    rules: tuple[Rule, ...]
    memo: bool = False

    def __post_init__(self) -> None:
        if self.memo and (isinstance(self.lists, str) or any(
                isinstance(b, Ref | Context) for rule in self.rules
                for b in (getattr(rule, "lo", None), getattr(rule, "hi", None)))):
            raise ValueError("only parallel lists under fixed bounds can be remembered")

    @property
    def row_names(self) -> tuple[str, ...]:
        return ("e",) if isinstance(self.lists, str) else tuple(n for n, _ in self.lists)

    def rows(self, r: object) -> Iterable[tuple[Any, ...]]:
        if isinstance(self.lists, str):
            return ((item,) for item in getattr(r, self.lists))
        return zip(*(getattr(r, attr) for _, attr in self.lists), strict=True)

    def fast_test(self, limits: Any) -> str:
        if isinstance(self.lists, str):
            item = _Scope(limits, lambda name: f"e.{name}")
            tests = " and ".join(f"({rule.test(item)})" for rule in self.rules)
            return f"all(({tests}) for e in r.{self.lists})"
        attrs = dict(self.lists)
        whole = _Scope(limits, lambda name: f"r.{attrs[name]}")
        test = " and ".join(rule.list_test(whole) for rule in self.rules)
        if not self.memo:
            return test
        key = ", ".join(f"tuple(r.{attr})" for attr in attrs.values())
        return f"((key := ({key},)) in _passed or _remember(_passed, key, {test}))"

    def row_scope(self, limits: Any) -> _Scope:
        if isinstance(self.lists, str):
            return _Scope(limits, lambda name: f"e.{name}")
        return _Scope(limits, lambda name: name)


@dataclass(frozen=True, eq=False)
class Kind:
    """Every rule of one record kind, in the order a reason is looked for: fields, groups, then
    columns (of the dtypes in ``dtypes``). ``declares`` names the field a valid record sets
    as its job's world size (for the ranks of the records after it)."""

    fields: tuple[Rule, ...]
    groups: tuple[Group, ...] = ()
    columns: tuple[Rule, ...] = ()
    dtypes: Mapping[str, str] | None = None
    declares: str | None = None


# -- the two checks of a kind -----------------------------------------------------------------

# Lists a memo group remembers, per kind and limits (cleared when full, like the window
# engine's cache of function dictionaries).
_MAX_REMEMBERED = 4096


def _remember(passed: set[tuple[Any, ...]], key: tuple[Any, ...], ok: bool) -> bool:
    if ok:
        if len(passed) >= _MAX_REMEMBERED:
            passed.clear()
        passed.add(key)
    return ok


# What rendered sources may use beyond the builtins.
_NAMESPACE: dict[str, Any] = {"_INF": math.inf, "_OPS": _OPS, "_remember": _remember}
_ARGS = "r, declared, world, latest_ns"
Fast = Callable[[Any, dict[str, int], dict[str, int], int], bool]


def _compiled(source: str, where: str) -> Any:
    """The function ``source`` spells; each has its own set of remembered lists."""
    return eval(compile(source, f"<rules of {where}>", "eval"), {**_NAMESPACE, "_passed": set()})


@dataclass(frozen=True)
class _Step:
    """One rule made ready to explain: its test and its operands, each a compiled function of
    the record (and the row's values, in a group)."""

    rule: Rule
    test: Callable[..., bool]
    operands: Callable[..., tuple[Any, ...]]

    def reason(self, args: tuple[Any, ...], row: tuple[Any, ...], at: str, why: Callable[[], str],
               i: int = -1) -> str | None:
        try:
            if self.test(*args, *row):
                return None
        except Exception as exc:  # a record built in Python may hold any type at all
            try:
                value = f"={_short(self.operands(*args, *row)[0])}"
            except Exception:
                value = ""
            return f"{self.rule.name}{at}{value} is unusable ({type(exc).__name__}: {exc})"
        try:
            operands = self.operands(*args, *row)
        except Exception as exc:  # a bound read from another field of any type (a list id)
            return f"{self.rule.name}{at} is unusable ({type(exc).__name__}: {exc})"
        return self.rule.describe(at, operands, _suffix(self.rule, why), args[0], i)


class Checks:
    """The fast and the explaining check of one :class:`Kind`, for one set of limits."""

    def __init__(self, kind: Kind, limits: Any, name: str) -> None:
        self.kind = kind
        self.limits = limits
        self.name = name
        self.columnar = bool(kind.columns)
        self.declares = kind.declares
        self.source = self._fast_source()
        self.ok: Fast = _compiled(self.source, name)
        self._column_tests = tuple(test for test in map(self._column_test, kind.columns)
                                   if not isinstance(test[0], Int) or test[1:] != (None, None))
        # After each test, the joined columns no later test reads: freed at once, a poll's
        # joined column is a few MB, and the allocator reuses a freed one for the next
        # (keeping them all costs a page fault per 4 KiB, twice the whole check).
        later: set[str] = set()
        done: list[tuple[str, ...]] = []
        for rule, _, _ in reversed(self._column_tests):
            done.append(tuple(set(rule.columns) - later))
            later |= set(rule.columns)
        self._done_after = tuple(reversed(done))

    def _fast_source(self) -> str:
        record = _Scope(self.limits, lambda name: f"r.{name}")
        tests = [rule.test(record) for rule in self.kind.fields]
        tests += [group.fast_test(self.limits) for group in self.kind.groups]
        return f"lambda {_ARGS}: " + (" and ".join(f"({t})" for t in tests) or "True")

    @cached_property
    def _steps(self) -> list[tuple[Group | None, list[_Step]]]:
        """Compiled on the first record that fails: most kinds never need it."""
        record = _Scope(self.limits, lambda name: f"r.{name}")
        out: list[tuple[Group | None, list[_Step]]] = [(None, [
            self._step(rule, record, _ARGS) for rule in self.kind.fields])]
        for group in self.kind.groups:
            args = ", ".join((_ARGS, *group.row_names))
            scope = group.row_scope(self.limits)
            out.append((group, [self._step(rule, scope, args) for rule in group.rules]))
        return out

    def _step(self, rule: Rule, scope: _Scope, args: str) -> _Step:
        return _Step(rule, _compiled(f"lambda {args}: {rule.test(scope)}", self.name),
                     _compiled(f"lambda {args}: {rule.operands(scope)}", self.name))

    def explain(self, r: Any, declared: dict[str, int], world: dict[str, int], latest_ns: int
                ) -> str | None:
        """The first rule of the fields and groups that ``r`` fails, as a one-line reason."""
        args = (r, declared, world, latest_ns)

        def why() -> str:
            return rank_bound(r.job_id, declared, world, self.limits.max_ranks)[1]

        for group, steps in self._steps:
            if group is None:
                for step in steps:
                    if (reason := step.reason(args, (), "", why)) is not None:
                        return reason
                continue
            for i, row in enumerate(group.rows(r)):
                at = "" if group.label else f"[{i}]"
                for step in steps:
                    if (reason := step.reason(args, row, at, why, i)) is not None:
                        return reason if not group.label else f"{group.label.format(i=i)}: {reason}"
        return None

    # numpy columns

    def _column_test(self, rule: Rule) -> tuple[Rule, Bound, Bound]:
        """The rule with each bound its column's dtype already guarantees left out (no int32
        exceeds 2**31 - 1, no uint64 is negative)."""
        if not isinstance(rule, Int) or not isinstance(rule.field, str):
            return rule, getattr(rule, "lo", None), getattr(rule, "hi", None)
        dtype = np.dtype((self.kind.dtypes or {})[rule.field])
        lo, hi = rule.lo, rule.hi
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            fixed = self._fixed(lo)
            lo = None if fixed is not None and fixed <= info.min else lo
            fixed = self._fixed(hi)
            hi = None if fixed is not None and fixed >= info.max else hi
        return rule, lo, hi

    def _fixed(self, bound: Bound) -> int | float | None:
        if isinstance(bound, Limit):
            return int(getattr(self.limits, bound.name)) - bound.minus
        return bound if isinstance(bound, int | float) else None

    def _resolved(self, bound: Bound, latest_ns: int, last_rank: Callable[[], Any]) -> Any:
        if isinstance(bound, Limit):
            return getattr(self.limits, bound.name) - bound.minus
        if bound is LATEST_NS:
            return latest_ns
        if bound is LAST_RANK:
            return last_rank()
        if isinstance(bound, Ref | Row):
            raise TypeError(f"{bound} cannot bound a numpy column")
        return bound

    def columns_ok(self, batches: list[tuple[Any, int]], latest_ns: int) -> bool:
        """The fast check of every column of a poll's batches of this kind, each column joined
        into one array: a few numpy reductions per column, whatever the number of batches."""
        joined = _Joined(batches, self.kind.dtypes or {})
        for (rule, lo, hi), done in zip(self._column_tests, self._done_after, strict=True):
            last_rank = partial(joined.last_rank, getattr(rule, "field", ""))
            if not rule.column_ok(joined, self._resolved(lo, latest_ns, last_rank),
                                  self._resolved(hi, latest_ns, last_rank)):
                return False
            joined.release(done)
        return True

    def column_reason(self, batch: Any, rank_end: int, why: str, latest_ns: int) -> str | None:
        """The first bad element of one batch's columns, by a mask per rule (the reference
        the joined reductions of :meth:`columns_ok` are tested against)."""
        for rule in self.kind.columns:
            lo = self._resolved(getattr(rule, "lo", None), latest_ns, lambda: rank_end - 1)
            hi = self._resolved(getattr(rule, "hi", None), latest_ns, lambda: rank_end - 1)
            bad = rule.column_bad(batch.column, lo, hi)
            if bad.any():
                i = int(np.argmax(bad))
                operands = rule.column_operands(batch.column, i, lo, hi)
                return rule.describe(f"[{i}]", operands, _suffix(rule, lambda: why), batch, i)
        return None


class _Joined:
    """A poll's batches of one kind; each column joined into one array on first use."""

    def __init__(self, batches: list[tuple[Any, int]], dtypes: Mapping[str, str]) -> None:
        self._batches = batches
        self._records = [b for b, _ in batches]
        self._dtypes = dtypes
        self._arrays: dict[str, np.ndarray] = {}

    def __call__(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            # map() over an attrgetter: join() builds its list in C, where a comprehension of
            # getattr calls runs Python per batch (thousands of batches a poll, a dozen
            # columns each).
            raw = b"".join(map(operator.attrgetter(name), self._records))
            self._arrays[name] = np.frombuffer(raw, dtype=self._dtypes[name])
        return self._arrays[name]

    def release(self, names: Iterable[str]) -> None:
        for name in names:
            self._arrays.pop(name, None)

    def last_rank(self, name: str) -> int | np.ndarray:
        """Each element's batch's last rank: one number when all batches share it."""
        ends = [end for _, end in self._batches]
        if len(set(ends)) == 1:
            return ends[0] - 1
        width = np.dtype(self._dtypes[name]).itemsize
        return np.repeat(np.array(ends) - 1, [len(getattr(b, name)) // width
                                              for b, _ in self._batches])


def _suffix(rule: Rule, why: Callable[[], str]) -> str:
    """Where a bound is the job's ranks, the reason says where that bound comes from."""
    return f", {why()}" if isinstance(rule, Int) and LAST_RANK in (rule.lo, rule.hi) else ""


def rank_bound(job_id: str, declared: Mapping[str, int], world: Mapping[str, int],
               max_ranks: int) -> tuple[int, str]:
    """The job's rank bound (exclusive) and why it is that."""
    size = declared.get(job_id) or world.get(job_id)
    if size is None:
        return max_ranks, f"no topology known for job {job_id!r}"
    return size, f"job {job_id!r} declares a world size of {size}"


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
