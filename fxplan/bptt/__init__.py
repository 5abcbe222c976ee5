"""Memory-efficient backpropagation through time (Gruslys et al. 2016).

``solve`` / ``optimal_cost`` solve the BPTT-HSM, BPTT-ISM and BPTT-MSM dynamic programs (and express
Chen et al.'s sqrt(t) and recursive schedules as baseline policies); ``simulate`` turns a policy into
the action sequence; ``backward`` runs that sequence on any recurrent core ``core(x_t, h) -> (y_t, h')``.
"""

from fxplan.bptt.executor import BackwardStats, backward, plan
from fxplan.bptt.schedule import Schedule, build, simulate
from fxplan.bptt.solvers import HIDDEN, INTERNAL, POLICIES, Policy, optimal_cost, solve

__all__ = [
    "HIDDEN",
    "INTERNAL",
    "POLICIES",
    "BackwardStats",
    "Policy",
    "Schedule",
    "backward",
    "build",
    "optimal_cost",
    "plan",
    "simulate",
    "solve",
]
