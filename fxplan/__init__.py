"""fxplan: optimal recomputation planning for PyTorch training, on torch.fx.

Public modules besides what is re-exported here: ``fxplan.costs.trace`` (model -> CostGraph),
``fxplan.measure.meter``, ``fxplan.solvers.dp`` and ``fxplan.solvers.chen`` (solvers on a CostGraph),
``fxplan.rewriter.codegen`` (plan -> GraphModule), ``fxplan.bptt`` (memory-efficient BPTT).
"""

from fxplan import bptt
from fxplan.api import min_budget_bytes, plan, rewrite
from fxplan.apply.applied import AppliedPlan, PartialPlan
from fxplan.apply.auto import auto_checkpoint, remove_checkpoints
from fxplan.errors import BudgetError, FxplanError, TraceError
from fxplan.measure.meter import StepStats, measure_step
from fxplan.measure.tracker import track_memory
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.plans import Plan

__all__ = [
    "AppliedPlan", "BudgetError", "CostGraph", "FxplanError", "PartialPlan", "Plan", "StepStats", "TraceError",
    "auto_checkpoint", "bptt", "measure_step", "min_budget_bytes", "plan", "remove_checkpoints", "rewrite",
    "track_memory",
]
__version__ = "0.1.0"
