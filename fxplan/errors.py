"""Exceptions that users can cause and act on.

Every error fxplan raises on purpose derives from :class:`FxplanError`, and its message says what to do.
"""

from __future__ import annotations

import inspect
import os
import traceback
from typing import Any

import torch


class FxplanError(Exception):
    """Base class of every error fxplan raises on purpose."""


class TraceError(FxplanError):
    """The model cannot be traced by torch.fx (data-dependent control flow, unsupported ops, ...)."""


class BudgetError(FxplanError):
    """No recomputation plan fits the memory budget asked for.

    ``min_feasible_bytes`` is the smallest budget for which a plan exists (or ``None`` if unknown). The message is
    ``fact`` (what does not fit) followed by ``advice`` in the terms of the Python API (``budget_bytes=...``); the
    command line shows ``fact`` with advice in its own terms (its flags) instead.
    """

    def __init__(self, message: str, min_feasible_bytes: int | None = None, *, advice: str = ""):
        super().__init__(f"{message} {advice}" if advice else message)
        self.min_feasible_bytes = min_feasible_bytes
        self.fact = message
        self.advice = advice


_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (torch.__file__, __file__))


def user_frame(exc: BaseException, model: Any = None) -> str:
    """`` (at file:line: code)`` for the innermost frame of ``exc`` in the source of ``model``'s module classes,
    else outside torch and fxplan, or ''. The exceptions ``exc`` was raised from count, not another capturer's
    failure it was raised while handling (export's after symbolic_trace's)."""
    frames = traceback.extract_tb(exc.__traceback__)
    cause = exc.__cause__ or exc.__context__
    while cause is not None and not isinstance(cause, TraceError):
        frames += traceback.extract_tb(cause.__traceback__)
        cause = cause.__cause__ or cause.__context__
    # frames with source lines only: generated code (fx's, export's "<string>") has none to show
    outside = [f for f in frames if not f.filename.startswith(_LIBRARY_DIRS) and f.line]
    sources = {_source_file(type(m)) for m in model.modules()} if model is not None else set()
    own = [f for f in outside if f.filename in sources]
    if not (own or outside):
        return ""
    f = (own or outside)[-1]
    return f" (at {f.filename}:{f.lineno}: {f.line})"


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (300 characters at most), or its type's name if it has none."""
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _source_file(cls: type) -> str | None:
    try:
        return inspect.getsourcefile(cls)
    except (TypeError, OSError):  # a class made in an interpreter session
        return None
