"""Turn a solved policy into the flat action sequence the executor runs (appendix A, Algorithm 2).

The executor keeps a stack of stored states; the bottom entry is the initial hidden state ``h0``.
A *cursor* holds the current hidden state and always restarts from the top of the stack after a push,
pop or backward step. The five actions are

``(RUN, n)``         ``n`` forward steps without autograd from the cursor (``n`` forward operations)
``(PUSH, 0)``        store the cursor's hidden state on the stack (Q1, eq. (1)/(6))
``(GRAD, units)``    one forward step with autograd; its internal state goes on the stack and occupies
                     ``units`` memory units (Q2, eq. (4)/(7)/(10); 0 for HSM's working step)
``(BACKWARD, 0)``    back-propagate through the internal state on top of the stack and drop it
``(POP, 0)``         drop the hidden state on top of the stack

:func:`build` expands the recursion of section 3 without Python recursion (ISM chains are t deep), and
:func:`simulate` replays the actions and checks what the DP promises: every step is back-propagated
once in reverse order, the forward operations equal ``C(t, m)``, and the memory held never exceeds ``m``.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxplan.bptt.policy import HIDDEN, INF, Policy
from fxplan.errors import FxplanError

RUN, PUSH, GRAD, BACKWARD, POP = range(5)
NAMES = {RUN: "run", PUSH: "push", GRAD: "grad", BACKWARD: "backward", POP: "pop"}


@dataclass(frozen=True)
class Schedule:
    """A flat action sequence for ``t`` steps and what it costs.

    ``forward_ops``: core forward calls; ``peak_units``: most memory units held at once (the policy's
    units, root hidden state included for HSM/MSM); ``peak_stored``: most states (hidden or internal,
    root and working step included) held at once.
    """

    t: int
    m: int
    actions: tuple[tuple[int, int], ...]
    forward_ops: int
    peak_units: int
    peak_stored: int

    def describe(self) -> str:
        """Readable one-line-per-action listing, for debugging and docs."""
        return "\n".join(f"{NAMES[op]} {arg}" if op in (RUN, GRAD) else NAMES[op] for op, arg in self.actions)


def build(policy: Policy, t: int | None = None, m: int | None = None) -> list[tuple[int, int]]:
    """Expand ``policy`` for ``t`` steps and ``m`` units into actions (Algorithm 2, iteratively)."""
    t = policy.t if t is None else t
    m = policy.m if m is None else m
    if policy.C.ndim == 2:
        if t > policy.C.shape[0] - 1 or m < 1:
            raise FxplanError(f"policy solved for t <= {policy.C.shape[0] - 1}, asked for t={t}, m={m}")
        m = min(m, policy.C.shape[1] - 1)
        if policy.C[t, m] >= INF:
            raise FxplanError(f"no {policy.name} schedule for t={t} with m={m}")
    actions: list[tuple[int, int]] = []
    # Work stack of pending tasks: ("solve", t, m) or a literal action to emit.
    work: list[tuple] = [("solve", t, m)]
    while work:
        task = work.pop()
        if task[0] != "solve":
            actions.append(task)
            continue
        _, n, mm = task
        if n == 0:
            continue
        kind, y = policy.decide(n, mm)
        if kind == HIDDEN:
            # forward y, push h_y, solve the right part with one slot less, pop, solve the left part.
            actions += [(RUN, y), (PUSH, 0)]
            work += [("solve", y, mm), (POP, 0), ("solve", n - y, mm - policy.hidden_units)]
        else:
            units = 0 if y == n and policy.name != "ism" else policy.internal_units(y)
            if y > 1:
                actions.append((RUN, y - 1))
            actions.append((GRAD, units))
            work += [("solve", y - 1, mm), (BACKWARD, 0), ("solve", n - y, mm - units)]
    return actions


def simulate(policy: Policy, t: int | None = None, m: int | None = None) -> Schedule:
    """Build the actions and replay them abstractly; raise if they are not a valid BPTT schedule."""
    t = policy.t if t is None else t
    m = policy.m if m is None else m
    actions = build(policy, t, m)
    # stack entries: (position, units, is_internal); the root h0 occupies hidden_units.
    root_units = policy.hidden_units if policy.name != "ism" else 0
    stack = [(0, root_units, False)]
    units = root_units
    peak_units, peak_stored = units, 1
    cursor = 0
    grad_at = t  # the next step to back-propagate
    forward_ops = 0
    for op, arg in actions:
        if op == RUN:
            cursor += arg
            forward_ops += arg
            if cursor >= grad_at:
                raise FxplanError(f"invalid schedule: ran to step {cursor} past pending step {grad_at}")
        elif op == PUSH:
            stack.append((cursor, policy.hidden_units, False))
            units += policy.hidden_units
            cursor = stack[-1][0]
        elif op == GRAD:
            cursor += 1
            forward_ops += 1
            if cursor > grad_at:
                raise FxplanError(f"invalid schedule: step {cursor} computed past pending step {grad_at}")
            stack.append((cursor, arg, True))
            units += arg
        elif op == BACKWARD:
            pos, u, internal = stack.pop()
            if not internal or pos != grad_at:
                raise FxplanError(f"invalid schedule: backward at {pos}, expected step {grad_at}")
            grad_at -= 1
            units -= u
            cursor = stack[-1][0]
        else:  # POP
            pos, u, internal = stack.pop()
            if internal:
                raise FxplanError("invalid schedule: pop of an internal state")
            units -= u
            cursor = stack[-1][0]
        peak_units = max(peak_units, units)
        peak_stored = max(peak_stored, len(stack))
    if grad_at != 0 or len(stack) != 1:
        raise FxplanError(f"invalid schedule: stopped with step {grad_at} pending")
    return Schedule(t, m, tuple(actions), forward_ops, peak_units, peak_stored)
