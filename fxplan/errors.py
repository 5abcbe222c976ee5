"""Exceptions that users can cause and act on.

Every error fxplan raises on purpose derives from :class:`FxplanError`, and its message says what to do.
"""

from __future__ import annotations


class FxplanError(Exception):
    """Base class of every error fxplan raises on purpose."""


class TraceError(FxplanError):
    """The model cannot be traced by torch.fx (data-dependent control flow, unsupported ops, ...)."""


class BudgetError(FxplanError):
    """No recomputation plan fits the memory budget asked for.

    ``min_feasible_bytes`` is the smallest budget for which a plan exists (or ``None`` if unknown).
    """

    def __init__(self, message: str, min_feasible_bytes: int | None = None):
        super().__init__(message)
        self.min_feasible_bytes = min_feasible_bytes
