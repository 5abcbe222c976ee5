"""Operators and functions as pickle can save them: by name, resolved again on loading.

Rewritten modules and the recipes of recomputed inputs hold ATen operators (which pickle cannot save) and
functions made inside other functions (``torch.nn.functional.max_pool2d`` is made by ``boolean_dispatch``,
so pickle cannot find it by its qualified name). :func:`portable_target` names them; :func:`restored` gives
them back.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Any

import torch


def restored(saved: Any) -> Any:
    """What :func:`portable_target` made portable, back as it was."""
    return saved.resolve() if isinstance(saved, (_OperatorName, _FunctionName)) else saved


def portable_target(target: Any) -> Any:
    """``target`` as pickle can save it: ATen and higher-order operators by name, functions made inside others
    by their module's name for them; anything else as it is."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return _OperatorName.of(target)
    if callable(target) and "<locals>" in getattr(target, "__qualname__", ""):
        return _FunctionName.of(target)
    return target


@dataclasses.dataclass(frozen=True)
class _OperatorName:
    """``torch.ops.<namespace>.<name>[.<overload>]``, which pickle cannot save as the operator itself."""

    namespace: str
    name: str
    overload: str | None

    @staticmethod
    def of(op: Any) -> _OperatorName:
        if isinstance(op, torch._ops.HigherOrderOperator):
            return _OperatorName("higher_order", op.name(), None)
        return _OperatorName(op.namespace, op._schema.name.split("::", 1)[1], op._overloadname)

    def resolve(self) -> Any:
        op = getattr(getattr(torch.ops, self.namespace), self.name)
        return op if self.overload is None else getattr(op, self.overload)


@dataclasses.dataclass(frozen=True)
class _FunctionName:
    """A function made inside another that its module exposes by name (``torch.nn.functional.max_pool2d`` is
    made by ``boolean_dispatch``): pickle finds functions by their qualified name, which such a one lacks."""

    module: str
    name: str

    @staticmethod
    def of(function: Any) -> Any:
        """The function's name where its module exposes it under that name, else the function itself."""
        module, name = getattr(function, "__module__", None), getattr(function, "__name__", None)
        if module and name and getattr(sys.modules.get(module), name, None) is function:
            return _FunctionName(module, name)
        return function

    def resolve(self) -> Any:
        return getattr(importlib.import_module(self.module), self.name)
