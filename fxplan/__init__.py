"""fxplan: optimal recomputation planning for PyTorch training, on torch.fx."""

from fxplan.costgraph import CostGraph
from fxplan.errors import BudgetError, FxplanError, TraceError

__all__ = ["BudgetError", "CostGraph", "FxplanError", "TraceError"]
__version__ = "0.1.0"
