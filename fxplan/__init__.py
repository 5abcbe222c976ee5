"""fxplan: optimal recomputation planning for PyTorch training, on torch.fx.

Public modules besides what is re-exported here: ``fxplan.trace`` (model -> CostGraph),
``fxplan.measure``, ``fxplan.dp`` and ``fxplan.chen`` (solvers on a CostGraph), ``fxplan.codegen``
(plan -> GraphModule), ``fxplan.bptt`` (memory-efficient BPTT).
"""

from fxplan import bptt
from fxplan.costgraph import CostGraph
from fxplan.errors import BudgetError, FxplanError, TraceError
from fxplan.measure import StepStats, measure_step, track_memory
from fxplan.plans import Plan
from fxplan.rewriting import min_budget_bytes, plan, rewrite

__all__ = [
    "BudgetError", "CostGraph", "bptt", "FxplanError", "Plan", "StepStats", "TraceError", "measure_step",
    "min_budget_bytes", "plan", "rewrite", "track_memory",
]
__version__ = "0.1.0"
