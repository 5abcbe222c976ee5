"""A solved BPTT policy: the tables C, D, H of Gruslys et al. (2016), shared by the solvers and the schedule.

Kept apart from :mod:`fxplan.bptt.solvers` so that :mod:`fxplan.bptt.schedule` (which expands a policy into
actions) and the solvers (which use the schedule to size Chen's baselines) import it without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INF = 1 << 60
HIDDEN = 0
INTERNAL = 1

POLICIES = ("hsm", "ism", "msm", "chen_sqrt", "chen_recursive")


@dataclass(frozen=True)
class Policy:
    """Solved policy tables for sequences up to ``t`` steps and memory up to ``m`` units.

    ``C[t', m']`` is the optimal number of forward operations (``INF`` when infeasible), ``D[t', m']``
    the position of the first push and ``H[t', m']`` its kind (:data:`HIDDEN` or :data:`INTERNAL`).
    For the Chen baselines the tables do not depend on memory: they are 1-D, indexed by ``t'`` only,
    and ``m`` is the memory (in MSM units) the baseline needs for ``t`` steps.
    """

    name: str
    t: int
    m: int
    alpha: int | None
    beta: int | None
    C: np.ndarray
    D: np.ndarray
    H: np.ndarray

    def internal_units(self, y: int) -> int:
        """Memory units an internal state pushed at relative position ``y`` occupies (section 3.4)."""
        if self.name == "ism":
            return 1
        if self.name == "hsm":
            return 0  # only ever the working state
        assert self.alpha is not None and self.beta is not None
        return self.beta if y == 1 else self.alpha

    @property
    def hidden_units(self) -> int:
        """Memory units one stored hidden state occupies (ISM stores none but the root)."""
        return 0 if self.name == "ism" else 1

    def decide(self, t: int, m: int) -> tuple[int, int]:
        """The first action ``(kind, y)`` for ``t`` remaining steps with ``m`` units."""
        if self.C.ndim == 1:
            return int(self.H[t]), int(self.D[t])
        return int(self.H[t, m]), int(self.D[t, m])

    def cost(self, t: int | None = None, m: int | None = None) -> int:
        """Forward operations for ``t`` steps with ``m`` units (defaults: the solved size)."""
        t = self.t if t is None else t
        if self.C.ndim == 1:
            return int(self.C[t])
        m = self.m if m is None else m
        return int(self.C[t, min(m, self.C.shape[1] - 1)])
