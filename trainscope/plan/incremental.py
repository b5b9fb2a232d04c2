"""The latency model's step time kept in parts, so that a swap of two groups' slots re-scores
only what it touches.

:class:`~trainscope.plan.latency.LatencyModel` scores a placement from scratch: O(GPUs) numpy
work, 200–700 µs at 4,096 GPUs. The step time is built from two kinds of part:

* per replica d, ``R[d, s] = T_pipe(d) − drain(d, s)`` (when stage s of replica d finishes its
  last backward, relative to the step start). It depends only on replica d's own slots.
* per stage s, the data-parallel all-reduce ``A[s]``: a ring over the replicas' slots of
  stage s, at the ring's slowest edge ``min_d bw(slot[d, s], slot[d + 1, s])``.

and ``step = max_s (max_d R[d, s] + A[s]) + optimizer``. A swap of groups (d1, s1) and (d2, s2)
changes the rows d1, d2 of R and, in columns s1 and s2, the ring edges next to the moved
groups; everything else is kept. Per swap this is O(pp) scalar work per touched replica plus
one max over R (dp × pp floats), instead of O(dp · pp · tp) array work.

A slot is tp consecutive GPUs of one host, so every lane of a slot sees the same host pair:
the bandwidth between two slots (lane i to lane i) is the intra-host bandwidth on one host,
else ``min(host pair, the two slots' slowest GPU caps)`` — the minimum over lanes the full
model takes, computed once per slot. Sums run in a different order than numpy's, so totals
agree with :meth:`LatencyModel.step_s` to float rounding (tests check 1e-9 relative).
"""

from __future__ import annotations

import numpy as np

from trainscope.plan.costs import ring_allreduce_s
from trainscope.plan.latency import LatencyModel


class IncrementalScore:
    """Step time of one placement, updated swap by swap.

    ``propose(a, b)`` returns the step time with the slots of flat groups a and b (index
    d · pp + s) swapped; then exactly one of ``accept()`` or ``reject()`` must follow."""

    def __init__(self, model: LatencyModel, slots: np.ndarray) -> None:
        cfg, c, links = model.cfg, model.costs, model.links
        self.model = model
        self.dp, self.pp, self.tp = dp, pp, tp = cfg.dp, cfg.pp, cfg.tp
        groups = dp * pp
        gpus = np.arange(groups)[:, None] * tp + np.arange(tp)  # (slot, lane)
        hosts = gpus // links.gpus_per_host
        if not (hosts == hosts[:, :1]).all():
            raise ValueError(f"tp {tp} does not divide {links.gpus_per_host} GPUs per host: "
                             "a slot would span hosts")
        self._host: list[int] = hosts[:, 0].tolist()
        self._cap: list[float] = links.gpu_cap_bytes_per_s[gpus].min(axis=-1).tolist()
        self._host_bw: list[list[float]] = links.host_bytes_per_s.tolist()
        self._intra = float(links.intra_bytes_per_s)
        # Tensor-parallel all-reduce per (slot, stage): the full model's own formula, once.
        if tp > 1:
            ring = links.between(gpus, np.roll(gpus, -1, axis=-1)).min(axis=-1)[:, None]
            tp_s = c.tp_allreduces * ring_allreduce_s(c.tp_bytes_per_layer, tp, ring)
        else:
            tp_s = np.zeros((groups, pp))
        # [slot][stage]: backward and forward + backward, as the full model splits tp_s.
        self._bwd: list[list[float]] = (c.backward_s + tp_s / 2).tolist()
        self._work: list[list[float]] = ((c.forward_s + tp_s / 2)
                                         + (c.backward_s + tp_s / 2)).tolist()
        self._p2p_bytes = float(c.p2p_bytes)
        self._ar_bytes = [2 * (dp - 1) / dp * float(g) for g in c.grad_bytes]
        self._m1 = model.m - 1
        self._optimizer_s = float(c.optimizer_s.max())
        self.slots: list[list[int]] = np.asarray(slots).reshape(dp, pp).tolist()
        self._r = [self._row(row) for row in self.slots]  # R[d][s]
        self._colmax_s = [max(r[s] for r in self._r) for s in range(pp)]
        # _edge[s][d]: bandwidth of stage s's ring edge from replica d to d + 1.
        self._edge = [[self._bw(self.slots[d][s], self.slots[(d + 1) % dp][s])
                       for d in range(dp)] for s in range(pp)]
        self._ar = [self._allreduce(s, self._edge[s]) for s in range(pp)]
        self.total = self._total(self._colmax_s, self._ar)
        self._pending: tuple | None = None

    def _bw(self, a: int, b: int) -> float:
        ha, hb = self._host[a], self._host[b]
        if ha == hb:
            return self._intra
        return min(self._host_bw[ha][hb], self._cap[a], self._cap[b])

    def _allreduce(self, s: int, edges: list[float]) -> float:
        return self._ar_bytes[s] / min(edges) if self.dp > 1 else 0.0

    def _row(self, row: list[int]) -> list[float]:
        """R[d, ·] of a replica whose stage s sits in slot row[s]. Long-hand (no _bw calls,
        locals only): this runs twice per proposed swap and is most of the search's time."""
        host, cap, host_bw, intra = self._host, self._cap, self._host_bw, self._intra
        p2p_bytes, bwd_of, work_of = self._p2p_bytes, self._bwd, self._work
        bwd = [bwd_of[g][s] for s, g in enumerate(row)]
        work = [work_of[g][s] for s, g in enumerate(row)]
        comm = []
        prev, h_prev = row[0], host[row[0]]
        for g in row[1:]:
            h = host[g]
            bw = intra if h == h_prev else min(host_bw[h_prev][h], cap[prev], cap[g])
            comm.append(p2p_bytes / bw)
            prev, h_prev = g, h
        # cycle[s] = work[s] + (comm[s − 1] + comm[s]), a missing neighbour counting 0.
        left, right = [0.0, *comm], [*comm, 0.0]
        cycle = max(w + (x + y) for w, x, y in zip(work, left, right, strict=True))
        pipe = sum(work) + 2 * sum(comm) + self._m1 * cycle
        out, drain = [pipe], 0.0
        for b, c in zip(bwd, comm, strict=False):
            drain += b + c
            out.append(pipe - drain)
        return out

    def _total(self, colmax: list[float], ar: list[float]) -> float:
        return max(x + y for x, y in zip(colmax, ar, strict=True)) + self._optimizer_s

    def _colmax(self, new_rows: dict[int, list[float]]) -> list[float]:
        """Per stage, the latest end of its last backward over replicas, with ``new_rows``
        replacing theirs. A column is re-scanned only when a replaced row held its maximum
        and its new value is lower (rarely: one replica of dp is the critical one)."""
        out = []
        for s, old_max in enumerate(self._colmax_s):
            new_max = max(row[s] for row in new_rows.values())
            if new_max < old_max and any(self._r[d][s] == old_max for d in new_rows):
                new_max = max(new_rows[d][s] if d in new_rows else r[s]
                              for d, r in enumerate(self._r))
            else:
                new_max = max(new_max, old_max)
            out.append(new_max)
        return out

    def propose(self, a: int, b: int) -> float:
        """Step time with groups a and b swapped; nothing changes until accept()."""
        pp, dp = self.pp, self.dp
        (da, sa), (db, sb) = divmod(a, pp), divmod(b, pp)
        slots = self.slots
        slots[da][sa], slots[db][sb] = slots[db][sb], slots[da][sa]
        new_rows = {d: self._row(slots[d]) for d in (da, db)}
        edges: dict[int, list[float]] = {}
        ar = self._ar
        if dp > 1:
            ar = list(ar)
            for d, s in ((da, sa), (db, sb)):
                col = edges.setdefault(s, list(self._edge[s]))
                for e in ((d - 1) % dp, d):
                    col[e] = self._bw(slots[e][s], slots[(e + 1) % dp][s])
            for s, col in edges.items():
                ar[s] = self._allreduce(s, col)
        slots[da][sa], slots[db][sb] = slots[db][sb], slots[da][sa]
        colmax = self._colmax(new_rows)
        new = self._total(colmax, ar)
        self._pending = (da, sa, db, sb, new_rows, colmax, edges, ar, new)
        return new

    def accept(self) -> None:
        assert self._pending is not None, "accept() without propose()"
        da, sa, db, sb, new_rows, colmax, edges, ar, new = self._pending
        self.slots[da][sa], self.slots[db][sb] = self.slots[db][sb], self.slots[da][sa]
        for d, row in new_rows.items():
            self._r[d] = row
        for s, col in edges.items():
            self._edge[s] = col
        self._colmax_s, self._ar, self.total, self._pending = colmax, ar, new, None

    def reject(self) -> None:
        assert self._pending is not None, "reject() without propose()"
        self._pending = None

    def placement(self) -> np.ndarray:
        return np.array(self.slots, dtype=np.int64)

    def rescore(self) -> float:
        """The current placement scored from scratch by the full model (the reference)."""
        return float(self.model.step_s(self.placement()))
