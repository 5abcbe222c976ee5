"""fxplan: optimal recomputation planning for PyTorch training, on torch.fx.

Public modules: ``fxplan.trace`` (model -> CostGraph), ``fxplan.measure`` (peak memory of a step).
"""

from fxplan.costgraph import CostGraph
from fxplan.errors import BudgetError, FxplanError, TraceError
from fxplan.measure import StepStats, measure_step, track_memory

__all__ = [
    "BudgetError", "CostGraph", "FxplanError", "StepStats", "TraceError", "measure_step", "track_memory",
]
__version__ = "0.1.0"
