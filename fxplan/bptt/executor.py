"""Run an optimal BPTT schedule on a recurrent core with PyTorch autograd (Gruslys et al., appendix A).

``backward(core, inputs, h0, loss_fn, slots=... | budget_bytes=...)`` is a drop-in replacement for::

    h, total = h0, 0
    for i in range(len(inputs)):
        y, h = core(inputs[i], h)
        total = total + loss_fn(y, i)
    total.backward()

that holds at most ``slots`` stored states instead of one autograd graph per step. Each step's graph is
built from detached leaves (its input hidden state and input), back-propagated on its own with the
gradient of the later steps, and dropped; the gradient of the input hidden state is the next carry.
Parameters accumulate ``.grad`` exactly as one big backward would (same per-step terms, same
reverse-time order), and ``h0``/``inputs`` receive their gradients at the end if they require grad.

Randomness: with ``preserve_rng_state`` (the default) every call of the core for step ``i`` (0-based)
runs with the global RNG seeded to ``s + i + 1`` (``s`` drawn once, or given), so a recomputed step sees
the same dropout mask as its first computation. The global RNG stream is left as it was plus that one
draw. ``loss_fn`` runs once per step, outside that seeding.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fxplan.bptt.schedule import BACKWARD, GRAD, POP, PUSH, RUN, Schedule, simulate
from fxplan.bptt.solvers import POLICIES, solve
from fxplan.errors import BudgetError, FxplanError


@dataclass
class BackwardStats:
    """What one :func:`backward` call did (pass ``stats=BackwardStats()`` to collect it).

    ``forward_calls``: calls of the core; ``peak_stored``: most states (hidden or internal, ``h0`` and
    the step being back-propagated included) held at once; ``peak_units``: the same in the policy's
    memory units; ``slots``/``alpha``/``beta``: the memory the schedule was planned for;
    ``hidden_bytes``/``internal_bytes``: measured sizes (``None`` when nothing was measured).
    """

    policy: str = ""
    slots: int = 0
    alpha: int | None = None
    beta: int | None = None
    forward_calls: int = 0
    peak_stored: int = 0
    peak_units: int = 0
    hidden_bytes: int | None = None
    internal_bytes: int | None = None
    schedule: Schedule | None = field(default=None, repr=False)


# ---------------------------------------------------------------- hidden-state structure (tensor/tuples)


def _flatten(h: Any, what: str) -> tuple[list[torch.Tensor], Any]:
    if isinstance(h, torch.Tensor):
        return [h], None
    if isinstance(h, (tuple, list)) and h:
        leaves, specs = [], []
        for item in h:
            sub, spec = _flatten(item, what)
            leaves += sub
            specs.append((len(sub), spec))
        return leaves, (type(h), specs)
    raise FxplanError(f"{what} must be a tensor or a non-empty tuple/list of tensors, got {type(h).__name__}")


def _unflatten(leaves: list[torch.Tensor], spec: Any) -> Any:
    if spec is None:
        return leaves[0]
    kind, specs = spec
    out, i = [], 0
    for n, sub in specs:
        out.append(_unflatten(leaves[i : i + n], sub))
        i += n
    return kind(out)


def _state_bytes(leaves: list[torch.Tensor]) -> int:
    return sum(x.numel() * x.element_size() for x in leaves)


# ---------------------------------------------------------------- the interpreter


class _Runner:
    """Executes schedule actions; one instance per :func:`backward` call."""

    def __init__(self, core, inputs, h0, loss_fn, preserve_rng_state: bool | int):
        self.core, self.inputs, self.loss_fn = core, inputs, loss_fn
        self.h0_leaves, self.spec = _flatten(h0, "h0")
        self.T = len(inputs)
        self.calls = 0
        self.losses: list[torch.Tensor | None] = [None] * self.T
        self.x_grad = isinstance(inputs, torch.Tensor) and inputs.requires_grad
        self.grad_inputs = torch.zeros_like(inputs) if self.x_grad else None
        if isinstance(preserve_rng_state, bool):
            self.seed = int(torch.randint(0, 2**62, ()).item()) if preserve_rng_state else None
        else:
            self.seed = int(preserve_rng_state)
        devices = {x.device for x in self.h0_leaves}
        if isinstance(inputs, torch.Tensor):
            devices.add(inputs.device)
        if isinstance(core, torch.nn.Module):
            devices |= {p.device for p in core.parameters()}
        self.cuda_devices = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        self.checked = False

    def _rng(self, p: int):
        if self.seed is None:
            return contextlib.nullcontext()
        return _seeded(self.seed + p, self.cuda_devices)

    def _x(self, p: int) -> torch.Tensor:
        x = self.inputs[p - 1]
        return x.detach() if isinstance(x, torch.Tensor) else x

    def _check_state(self, out_leaves: list[torch.Tensor]) -> None:
        if self.checked:
            return
        ref = self.h0_leaves
        if len(out_leaves) != len(ref) or any(a.shape != b.shape for a, b in zip(out_leaves, ref)):
            raise FxplanError(
                "core(x_t, h) must return (y_t, h_next) with h_next shaped like h0: got "
                f"{[tuple(a.shape) for a in out_leaves]} for h0 {[tuple(b.shape) for b in ref]}"
            )
        self.checked = True

    def _core(self, p: int, x: Any, h: list[torch.Tensor]):
        self.calls += 1
        with self._rng(p):
            if self.checked:
                return self.core(x, _unflatten(h, self.spec))
            try:
                return self.core(x, _unflatten(h, self.spec))
            except Exception as e:  # first call only: most likely h0 or inputs do not fit the core
                raise FxplanError(
                    f"core(inputs[{p - 1}], h0) failed with {type(e).__name__}: {e}. Check that h0 (shapes "
                    f"{[tuple(x.shape) for x in self.h0_leaves]}) and inputs[t] are what the core expects."
                ) from e

    def call(self, p: int, h: list[torch.Tensor]):
        """One forward step p (1-based) from hidden leaves h; returns (y, flat h_next)."""
        out = self._core(p, self._x(p), h)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise FxplanError("core(x_t, h) must return a pair (y_t, h_next)")
        leaves, _ = _flatten(out[1], "h_next returned by the core")
        self._check_state(leaves)
        return out[0], leaves

    def run(self, p: int, h: list[torch.Tensor], n: int) -> list[torch.Tensor]:
        with torch.no_grad():
            for q in range(p + 1, p + n + 1):
                _, h = self.call(q, h)
        return h

    def grad_step(self, p: int, h: list[torch.Tensor]):
        """Forward step p with autograd from detached leaves; returns the stored internal state."""
        h_in = [x.detach().requires_grad_(x.is_floating_point() or x.is_complex()) for x in h]
        x = self._x(p)
        x_leaf = None
        if self.x_grad:
            x_leaf = x.detach().requires_grad_(True)
        with torch.enable_grad():
            if x_leaf is not None:
                out = self._core(p, x_leaf, h_in)
                if not (isinstance(out, (tuple, list)) and len(out) == 2):
                    raise FxplanError("core(x_t, h) must return a pair (y_t, h_next)")
                y, h_out = out[0], _flatten(out[1], "h_next returned by the core")[0]
                self._check_state(h_out)
            else:
                y, h_out = self.call(p, h_in)
            loss = self.loss_fn(y, p - 1)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise FxplanError(f"loss_fn(y_t, t) must return a scalar tensor, got {type(loss).__name__}"
                              f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        return [p, loss, h_out, h_in, x_leaf, [o.detach() for o in h_out]]

    def backprop(self, entry, carry: list[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        p, loss, h_out, h_in, x_leaf, _ = entry
        roots, grads = [], []
        if loss.requires_grad:
            roots.append(loss)
            grads.append(torch.ones_like(loss))
        if carry is not None:
            for o, g in zip(h_out, carry):
                if g is not None and o.requires_grad:
                    roots.append(o)
                    grads.append(g)
        if roots:
            torch.autograd.backward(roots, grads)
        self.losses[p - 1] = loss.detach().reshape(())
        if x_leaf is not None and x_leaf.grad is not None:
            self.grad_inputs[p - 1] += x_leaf.grad
        return [x.grad if x.requires_grad else None for x in h_in]

    def execute(self, schedule: Schedule, first: list | None = None) -> tuple[int, int]:
        """Run the actions; ``first`` is an already computed internal state of step 1 (the probe)."""
        root = [x.detach() for x in self.h0_leaves]
        stack: list[tuple[bool, Any]] = [(False, (0, root))]  # (is_internal, entry)
        cur_p, cur_h = 0, root
        carry: list | None = None
        peak = 1

        def top():
            internal, e = stack[-1]
            return (e[0], e[5]) if internal else e

        for op, arg in schedule.actions:
            if op == RUN:
                if first is not None:  # step 1 was computed by the probe: reuse its output
                    cur_p, cur_h, n = 1, first[5], arg - 1
                    first = None
                else:
                    n = arg
                cur_h = self.run(cur_p, cur_h, n)
                cur_p += n
            elif op == GRAD:
                if first is not None:
                    entry, first = first, None
                else:
                    entry = self.grad_step(cur_p + 1, cur_h)
                stack.append((True, entry))
                cur_p, cur_h = entry[0], entry[5]
            elif op == PUSH:
                stack.append((False, (cur_p, cur_h)))
            elif op == BACKWARD:
                _, entry = stack.pop()
                carry = self.backprop(entry, carry)
                del entry
                cur_p, cur_h = top()
            elif op == POP:
                stack.pop()
                cur_p, cur_h = top()
            peak = max(peak, len(stack))
        # Gradients of the leaves upstream of the sequence: h0 and inputs.
        roots, grads = [], []
        for x, g in zip(self.h0_leaves, carry or []):
            if g is not None and x.requires_grad:
                roots.append(x)
                grads.append(g)
        if self.x_grad:
            roots.append(self.inputs)
            grads.append(self.grad_inputs)
        if roots:
            torch.autograd.backward(roots, grads)
        return peak, self.calls


@contextlib.contextmanager
def _seeded(seed: int, cuda_devices: list[int]):
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed % (2**63))
        yield


# ---------------------------------------------------------------- sizing and planning


class _NewStorages(TorchDispatchMode):
    """Records the storages that ops create (not views of existing ones) while it is active."""

    def __init__(self):
        super().__init__()
        self.new: set[int] = set()
        self.old: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ins = {x.untyped_storage().data_ptr() for x in tree_leaves((args, kwargs or {}))
               if isinstance(x, torch.Tensor)}
        self.old |= ins - self.new
        out = func(*args, **(kwargs or {}))
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor):
                ptr = x.untyped_storage().data_ptr()
                if ptr not in ins and ptr not in self.old:
                    self.new.add(ptr)
        return out


def _measure(runner: _Runner) -> tuple[list, int, int, int]:
    """Compute step 1 with autograd while recording what it saves; return (entry, hid, int, in_hid).

    Internal bytes: distinct storages that autograd saves for the step and that the step created
    (parameters, inputs, targets and other tensors that live anyway are left out), plus its output
    hidden state and its input hidden state if saved (Definition 3). ``in_hid`` is the part shared with
    the input hidden state (what section 3.4 saves when that state is already stored).
    """
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return t

    h_start = [x.detach() for x in runner.h0_leaves]
    in_ptrs = {x.untyped_storage().data_ptr() for x in h_start}
    mode = _NewStorages()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
        entry = runner.grad_step(1, h_start)
    for o in entry[2]:
        st = o.untyped_storage()
        saved.setdefault(st.data_ptr(), st.nbytes())
    keep = mode.new | in_ptrs
    internal = sum(n for p, n in saved.items() if p in keep and p != 0)
    in_hid = sum(n for p, n in saved.items() if p in in_ptrs)
    hidden = _state_bytes(runner.h0_leaves)
    return entry, hidden, internal, in_hid


def plan(policy: str, t: int, *, slots: int | None = None, budget_bytes: int | None = None,
         hidden_bytes: int | None = None, internal_bytes: int | None = None,
         alpha: int | None = None, beta: int | None = None) -> tuple[Schedule, int, int | None, int | None]:
    """Choose the memory size and build the schedule; return ``(schedule, slots, alpha, beta)``.

    With ``budget_bytes``, the bytes the executor may hold in states are ``budget_bytes``: stored hidden
    states (``h0`` included) and internal states plus the working step, i.e. HSM and MSM get
    ``(budget - internal) // hidden`` units and ISM ``(budget - hidden) // internal`` internal states.
    """
    if policy not in POLICIES:
        raise FxplanError(f"unknown BPTT policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if (slots is None) == (budget_bytes is None):
        raise FxplanError("pass exactly one of slots= (memory units of the policy) or budget_bytes=")
    if policy in ("msm", "chen_sqrt") and alpha is None:
        if not (hidden_bytes and internal_bytes):
            raise FxplanError(f"policy {policy!r} needs alpha (or measured state sizes)")
        alpha = max(1, math.ceil(internal_bytes / hidden_bytes))
    if policy not in ("msm", "chen_sqrt"):
        alpha = beta = None
    elif beta is None:
        beta = alpha
    if budget_bytes is not None:
        hid, inn = hidden_bytes, internal_bytes
        if not (hid and inn):
            raise FxplanError("budget_bytes needs the measured hidden and internal state sizes")
        if budget_bytes < hid + inn:
            raise BudgetError(
                f"budget_bytes={budget_bytes} is below the least any schedule needs: one hidden state "
                f"({hid} B) plus one step's internal state ({inn} B); raise it to at least {hid + inn}",
                hid + inn,
            )
        slots = (budget_bytes - hid) // inn if policy == "ism" else (budget_bytes - inn) // hid
    assert slots is not None
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise FxplanError(f"slots must be an integer >= 1 (memory units of policy {policy!r}), got {slots!r}")
    # More memory than storing everything buys nothing: cap the table size.
    cap = {"hsm": t, "ism": t}.get(policy, 1 + (alpha or 1) * t)
    m = min(slots, cap)
    if policy.startswith("chen"):
        pol = solve(policy, t, alpha=alpha, beta=beta)
        if pol.m > slots:
            need = pol.m
            extra = ""
            if hidden_bytes and internal_bytes:
                extra = f" (budget_bytes >= {need * hidden_bytes + internal_bytes})"
            raise BudgetError(
                f"{policy} needs {need} memory units for t={t} but slots={slots}; give slots >= {need}"
                f"{extra} or use policy 'msm', which fits any memory",
                need * hidden_bytes + internal_bytes if hidden_bytes and internal_bytes else None,
            )
        return simulate(pol, t, pol.m), slots, alpha, beta
    pol = solve(policy, t, m, alpha=alpha, beta=beta)
    return simulate(pol, t, m), slots, alpha, beta


def backward(core: Callable, inputs: Any, h0: Any, loss_fn: Callable[[Any, int], torch.Tensor], *,
             slots: int | None = None, budget_bytes: int | None = None, policy: str = "msm",
             alpha: int | None = None, beta: int | None = None, preserve_rng_state: bool | int = True,
             stats: BackwardStats | None = None) -> torch.Tensor:
    """Forward and backward over the whole sequence with an optimal recomputation schedule.

    ``core(x_t, h) -> (y_t, h_next)`` is any callable (an ``nn.Module`` typically), ``h`` a tensor or a
    (nested) tuple of tensors; ``inputs`` is indexed along dim 0 (``inputs[t]`` is step ``t``'s input);
    ``loss_fn(y_t, t)`` returns a scalar. Gradients accumulate into the core's parameters, and into
    ``h0`` / ``inputs`` where they require grad. Returns the summed loss, detached.

    Memory: ``slots`` in the policy's units (``"hsm"``: hidden states, ``"ism"``: internal states,
    ``"msm"``/``"chen_sqrt"``: hidden-state units, an internal state costing ``alpha``), or
    ``budget_bytes`` for the states held (sizes measured on the first step, which is not recomputed for
    it). ``alpha``/``beta`` for MSM default to the measured ratios (beta: section 3.4).
    ``preserve_rng_state``: ``True`` runs step ``t`` (0-based) of the core under ``torch.manual_seed(s + t
    + 1)`` with ``s`` drawn once from the global RNG, an ``int`` gives ``s`` itself, ``False`` leaves the
    RNG alone (only for cores without randomness). Pass a
    :class:`BackwardStats` as ``stats`` to see the counts.
    """
    if policy not in POLICIES:
        raise FxplanError(f"unknown BPTT policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if not callable(core) or not callable(loss_fn):
        raise FxplanError("core and loss_fn must be callable")
    try:
        T = len(inputs)
    except TypeError:
        raise FxplanError("inputs must be indexable along dim 0 (a tensor or a sequence)") from None
    if T < 1:
        raise FxplanError("inputs is empty: nothing to back-propagate")
    if (slots is None) == (budget_bytes is None):
        raise FxplanError("pass exactly one of slots= (memory units of the policy) or budget_bytes=")
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
        raise FxplanError(f"slots must be an integer >= 1 (memory units of policy {policy!r}), got {slots!r}")
    runner = _Runner(core, inputs, h0, loss_fn, preserve_rng_state)
    need_measure = budget_bytes is not None or (policy in ("msm", "chen_sqrt") and alpha is None)
    first = None
    hid = inn = None
    if need_measure:
        first, hid, inn, in_hid = _measure(runner)
        if alpha is None and policy in ("msm", "chen_sqrt"):
            alpha = max(1, math.ceil(inn / hid))
            beta = max(1, min(alpha, math.ceil((inn - in_hid) / hid)))
    schedule, slots, alpha, beta = plan(policy, T, slots=slots, budget_bytes=budget_bytes, hidden_bytes=hid,
                                        internal_bytes=inn, alpha=alpha, beta=beta)
    peak, calls = runner.execute(schedule, first)
    if stats is not None:
        stats.policy, stats.slots, stats.alpha, stats.beta = policy, slots, alpha, beta
        stats.forward_calls, stats.peak_stored, stats.peak_units = calls, peak, schedule.peak_units
        stats.hidden_bytes, stats.internal_bytes, stats.schedule = hid, inn, schedule
    total = runner.losses[0]
    for loss in runner.losses[1:]:
        total = total + loss
    return total.detach()
