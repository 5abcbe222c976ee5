"""A trial of torch.compile's kind of plan run by a backward of our own: not part of fxplan's planner.

Usage: python scripts/own_backward_trial.py [NAME ...] [--batch-size N] [--input-size H] [--rounds R]
                                            [--threads K] [--fxplan BUDGET ...]

Under an activation-memory budget torch.compile keeps every convolution's output and recomputes the
concatenation, BatchNorm and ReLU in front of it (``scripts/compile_recompute.py``), bit-exactly. fxplan's
segments cannot express that: a node whose saved input is recomputed is recomputed itself. This script
tries the plan on torchvision models by a graph pass over ``torch.fx.symbolic_trace``: every
``conv(relu(batch_norm(x)))``, with ``x`` a ``torch.cat`` or any value, where the concatenation, BatchNorm and
ReLU have no other reader, becomes one autograd function that saves only the region's inputs and the
convolution's weight; its backward recomputes the region (BatchNorm in training mode, running statistics
not updated again), runs ``aten.convolution_backward`` as autograd's convolution node does, and back-propagates
through the region. For each model (default: densenet161, resnet50) it prints the regions replaced; whether
two training steps equal the model's own bit for bit (outputs, every gradient, every buffer); the real peak of
one step (``fxplan.compare.real_step_peak``) of the model, the trial and ``torch.compile`` at
``activation_memory_budget`` 0.5 (``fxplan.peers.compile_peer``); with ``--fxplan``, also
``fxplan.rewrite`` of the trial's graph at each budget (GiB, or ``none`` for the smallest peak): fxplan's
segments over the replaced regions, checked for exactness the same way; and their steps timed
interleaved (``fxplan.timing.time_interleaved``: median of per-round ratios to the model's step,
interquartile range).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fxplan  # noqa: E402
from fxplan.compare import real_step_peak  # noqa: E402
from fxplan.peers import compile_peer  # noqa: E402
from fxplan.timing import describe_ratio, time_interleaved, training_step  # noqa: E402
from models_zoo import resolve  # noqa: E402


def _region(bn: nn.BatchNorm2d, cat_dim: int | None, inputs: tuple, first: bool) -> torch.Tensor:
    """relu(bn(cat(inputs) or inputs[0])); ``first``: the module's own forward (updates running statistics),
    else the same output without touching them."""
    x = torch.cat(inputs, cat_dim) if cat_dim is not None else inputs[0]
    y = bn(x) if first else F.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
    return F.relu(y)


class ConvOfRecomputedRegion(torch.autograd.Function):
    """conv(region(inputs)), saving the inputs and the weight only; the region is recomputed in backward."""

    @staticmethod
    def forward(ctx, conv: nn.Conv2d, bn: nn.BatchNorm2d, cat_dim: int | None, weight: torch.Tensor, *inputs):
        with torch.no_grad():
            y = F.conv2d(_region(bn, cat_dim, inputs, True), weight, None, conv.stride, conv.padding,
                         conv.dilation, conv.groups)
        ctx.conv, ctx.bn, ctx.cat_dim = conv, bn, cat_dim
        ctx.save_for_backward(weight, *inputs)
        return y

    @staticmethod
    def backward(ctx, grad):
        weight, *inputs = ctx.saved_tensors
        conv = ctx.conv
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in inputs]
            h = _region(ctx.bn, ctx.cat_dim, tuple(leaves), False)
        grad_h, grad_w, _ = torch.ops.aten.convolution_backward(
            grad, h.detach(), weight, None, list(conv.stride), list(conv.padding), list(conv.dilation), False,
            [0, 0], conv.groups, [True, True, False])
        torch.autograd.backward(h, grad_h)
        return (None, None, None, grad_w, *[t.grad for t in leaves])


def conv_of_recomputed_region(conv, bn, cat_dim, *inputs):
    return ConvOfRecomputedRegion.apply(conv, bn, cat_dim, conv.weight, *inputs)


def _only_reader(node: fx.Node, reader: fx.Node) -> bool:
    return list(node.users) == [reader]


def _is_module(gm: fx.GraphModule, node: fx.Node, cls: type) -> bool:
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), cls)


def _is_relu(gm: fx.GraphModule, node: fx.Node) -> bool:
    return _is_module(gm, node, nn.ReLU) or (node.op == "call_function" and node.target in (F.relu, torch.relu))


def transform(model: nn.Module) -> tuple[fx.GraphModule, int]:
    """The model with every matching region replaced (module docstring), and how many were."""
    gm = fx.symbolic_trace(model)
    replaced = 0
    for conv in list(gm.graph.nodes):
        if not _is_module(gm, conv, nn.Conv2d) or gm.get_submodule(conv.target).bias is not None:
            continue
        relu = conv.args[0]
        if not (isinstance(relu, fx.Node) and _is_relu(gm, relu) and _only_reader(relu, conv)):
            continue
        bn = relu.args[0]
        if not (_is_module(gm, bn, nn.BatchNorm2d) and _only_reader(bn, relu)):
            continue
        x, cat_dim, inputs = bn.args[0], None, (bn.args[0],)
        if x.op == "call_function" and x.target is torch.cat and _only_reader(x, bn):
            cat_dim = x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0)
            inputs = tuple(x.args[0])
        with gm.graph.inserting_before(conv):
            conv_mod = gm.graph.get_attr(conv.target)
            bn_mod = gm.graph.get_attr(bn.target)
            new = gm.graph.call_function(conv_of_recomputed_region, (conv_mod, bn_mod, cat_dim, *inputs))
        conv.replace_all_uses_with(new)
        for dead in (conv, relu, bn) + ((x,) if cat_dim is not None else ()):
            gm.graph.erase_node(dead)
        replaced += 1
    gm.recompile()
    return gm, replaced


def exact_steps(model: nn.Module, trial: nn.Module, inputs: tuple, loss, steps: int = 2) -> str:
    """Whether ``steps`` training steps of both, from the same state, agree bit for bit."""
    out = []
    for step in range(steps):
        results = []
        for m in (model, trial):
            m.zero_grad(set_to_none=True)
            y = m(*inputs)
            loss(y).backward()
            results.append(y)
        grads = [torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), trial.parameters())]
        bufs = [torch.equal(p, q) for p, q in zip(model.buffers(), trial.buffers())]
        out.append(f"step {step + 1}: output {'equal' if torch.equal(*results) else 'DIFFERS'}, gradients "
                   f"{sum(grads)}/{len(grads)}, buffers {sum(bufs)}/{len(bufs)} equal")
    return "; ".join(out)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", default=["densenet161", "resnet50"])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--input-size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fxplan", nargs="*", default=[], metavar="BUDGET",
                   help="also fxplan.rewrite of the trial's graph at these budgets (GiB, or none)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in args.names:
        entry = resolve(name)
        torch.manual_seed(0)
        model = entry.build()
        inputs = entry.example_inputs(args.batch_size, args.input_size)
        trial, replaced = transform(copy.deepcopy(model))
        print(f"{name} (batch {args.batch_size}, {args.input_size}², {args.threads} threads): {replaced} "
              "conv(relu(batch_norm(...))) regions replaced", flush=True)
        print("  exactness:", exact_steps(copy.deepcopy(model), trial, inputs, entry.loss), flush=True)
        rows = {"vanilla": copy.deepcopy(model), "trial": transform(copy.deepcopy(model))[0],
                "torch.compile@0.5": compile_peer(copy.deepcopy(model), 0.5)}
        rows["torch.compile@0.5"].warm_up(inputs, entry.loss)
        for budget in args.fxplan:
            gb = None if budget == "none" else float(budget)
            t0 = time.perf_counter()
            planned = fxplan.rewrite(transform(copy.deepcopy(model))[0], gb, example_inputs=inputs,
                                     loss_fn=entry.loss)
            print(f"  fxplan on trial@{budget}: planned in {time.perf_counter() - t0:.1f} s; exactness:",
                  exact_steps(copy.deepcopy(model), planned, inputs, entry.loss), flush=True)
            rows[f"fxplan on trial@{budget}"] = planned
        peaks = {k: real_step_peak(m, inputs, entry.loss, torch.device("cpu"))[0] for k, m in rows.items()}

        timings = time_interleaved({k: training_step(m, inputs, entry.loss) for k, m in rows.items()},
                                   baseline="vanilla", rounds=args.rounds, threads=args.threads)
        for k, t in timings.items():
            ratio = describe_ratio(t.ratio, *(t.ratio_range or (None, None)))
            print(f"  {k:24} peak {peaks[k] / 2**20:8.1f} MiB ({100 * (peaks[k] / peaks['vanilla'] - 1):+.1f}%), "
                  f"step {t.median:.3f} s, ratio to vanilla {ratio}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
