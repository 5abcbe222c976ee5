"""fxplan: optimal recomputation planning for PyTorch training, on torch.fx."""

from fxplan.costgraph import CostGraph
from fxplan.errors import BudgetError, FxplanError, TraceError
from fxplan.measure import StepStats, measure_step, track_memory
from fxplan.trace import trace

__all__ = [
    "BudgetError", "CostGraph", "FxplanError", "StepStats", "TraceError", "measure_step", "trace",
    "track_memory",
]
__version__ = "0.1.0"
