"""What torch.compile recomputes under an activation-memory budget, and whether it stays bit-exact.

Usage: python scripts/compile_recompute.py [NAME ...] [--batch-size N] [--input-size H] [--budget F]

For each zoo name (default: densenet121, resnet50), the model is compiled as ``fxplan.compare.peers.compile_peer``
compiles it (``aot_eager``, the min-cut partitioner, ``activation_memory_budget`` F), with the forward and
backward graphs it runs captured. Printed per model: the ATen operators of the forward graph, and those
of the backward graph that no incoming gradient reaches (forward work run again from saved values: the
recomputation), counted by name; then whether the compiled step's output and every parameter's gradient
equal the eager step's bit for bit (same weights, same inputs, one step each on the CPU).
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys
from pathlib import Path

import torch
import torch._functorch.config as functorch_config
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from models_zoo import resolve  # noqa: E402

#: Operators that compute nothing (tuple items, views, copies): not counted.
_BOOKKEEPING = {"getitem", "detach.default", "view.default", "t.default", "slice.Tensor", "copy_.default",
                "expand.default", "clone.default", "alias.default"}


def _counted(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).split(".", 1)[-1] not in _BOOKKEEPING \
        and "getitem" not in str(node.target)


def forward_ops(gm: torch.fx.GraphModule) -> collections.Counter:
    return collections.Counter(str(n.target) for n in gm.graph.nodes if _counted(n))


def recomputed_ops(backward: torch.fx.GraphModule) -> collections.Counter:
    """Operators of the backward graph that no incoming gradient (``tangents_*``) reaches: forward work
    run again from saved values, not gradient computation."""
    from_grads: set[torch.fx.Node] = set()
    out = collections.Counter()
    for n in backward.graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(a in from_grads for a in n.all_input_nodes):
            from_grads.add(n)
        elif _counted(n):
            out[str(n.target)] += 1
    return out


def compiled_graphs(model: torch.nn.Module, inputs: tuple, loss, fraction: float) -> tuple[list, object, dict]:
    """(forward and backward graphs, compiled output, gradients by parameter name) of one compiled step."""
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm, _example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=keep, partition_fn=min_cut_rematerialization_partition,
                           keep_inference_input_mutations=True)  # aot_eager, with the graphs kept
    compiled = torch.compile(model, backend=backend)
    with functorch_config.patch(activation_memory_budget=fraction):
        out = compiled(*inputs)
        loss(out).backward()
    return graphs, out, {n: p.grad for n, p in model.named_parameters()}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", default=["densenet121", "resnet50"])
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--input-size", type=int, default=64)
    p.add_argument("--budget", type=float, default=0.5, help="activation_memory_budget")
    args = p.parse_args(argv)
    for name in args.names:
        entry = resolve(name)
        torch.manual_seed(0)
        model = entry.build()
        inputs = entry.example_inputs(args.batch_size, args.input_size)
        eager = copy.deepcopy(model)
        eager_out = eager(*inputs)
        entry.loss(eager_out).backward()
        graphs, out, grads = compiled_graphs(model, inputs, entry.loss, args.budget)
        forward, again = forward_ops(graphs[0]), recomputed_ops(graphs[-1])
        same_grads = sum(torch.equal(grads[n], q.grad) for n, q in eager.named_parameters())
        print(f"{name} (batch {args.batch_size}, {args.input_size}², activation_memory_budget {args.budget}):")
        print("  forward ops:", dict(sorted(forward.items())))
        print("  recomputed in backward:", dict(sorted(again.items())) or "nothing")
        print(f"  output equal to eager bit for bit: {torch.equal(out, eager_out)}; gradients equal: "
              f"{same_grads} of {len(grads)}")


if __name__ == "__main__":
    main(sys.argv[1:])
