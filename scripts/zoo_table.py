"""Print the models_zoo table (docs/zoo.md): paper settings, torch.fx compute-node counts, parameter counts.

Usage: ``python scripts/zoo_table.py [--peak] [NAME ...]`` (all networks by default). Compute nodes are the
nodes of ``torch.fx.symbolic_trace(model)`` whose op is call_module, call_function or call_method
(placeholders, get_attr and output excluded), each model built in train mode; "–" where symbolic_trace
cannot take the model (the transformers). ``fake_only`` entries are built on the meta device. ``--peak``
adds the vanilla peak of one training step (parameters, inputs, activations, gradients) at the paper's batch and input,
measured exactly with fake tensors by ``fxplan.measure.meter.measure_step(..., fake=True)`` and the entry's loss.
``--kinds`` prints, instead of the table, each named network's compute nodes counted by op kind and by
top-level submodule.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
import torch.fx
from torch._subclasses import FakeTensorMode

import models_zoo

COMPUTE_OPS = ("call_module", "call_function", "call_method")


def compute_nodes(model: torch.nn.Module) -> str:
    """Number of compute nodes of the model's torch.fx graph, or "–" if symbolic_trace cannot take it."""
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception:  # torch.fx raises many types; all mean "not traceable"
        return "–"
    return str(sum(n.op in COMPUTE_OPS for n in graph.nodes))


def _kind(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    return getattr(node.target, "__name__", str(node.target))


def _owner(node: torch.fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target).split(".")[0]
    stack = list(node.meta.get("nn_module_stack", {}).values())
    return stack[0][0].split(".")[0] if stack else "(top level)"


def print_kinds(name: str) -> None:
    """Compute nodes of one network by op kind and by top-level submodule."""
    gm = torch.fx.symbolic_trace(models_zoo.get(name).build())
    nodes = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    for title, key in (("kind", lambda n: _kind(gm, n)), ("submodule", _owner)):
        counts = Counter(key(n) for n in nodes)
        listing = ", ".join(f"{k} {v}" for k, v in counts.items())
        print(f"{name}: {len(nodes)} compute nodes by {title}: {listing}")


def vanilla_peak_gib(entry: models_zoo.ZooEntry, model: torch.nn.Module) -> float:
    """Peak GiB of one plain training step at the paper's settings, measured on fake tensors."""
    from fxplan.measure.meter import measure_step

    with FakeTensorMode():
        inputs = entry.example_inputs()
    return measure_step(model, inputs, fake=True, loss_fn=entry.loss).peak_bytes / 2**30


def main(argv: list[str]) -> None:
    peak = "--peak" in argv
    rows = [a for a in argv if a not in ("--peak", "--kinds")] or models_zoo.names()
    if "--kinds" in argv:
        for name in rows:
            print_kinds(name)
        return
    print(f"torch {torch.__version__}, command: python scripts/zoo_table.py {' '.join(argv)}".rstrip())
    print()
    extra = " vanilla peak (GiB) |" if peak else ""
    print(f"| network | paper batch | input | paper #V | fxplan FX nodes | parameters |{extra} description |")
    print("| --- | ---: | --- | ---: | ---: | ---: |" + (" ---: |" if peak else "") + " --- |")
    for name in rows:
        e = models_zoo.get(name)
        model = e.build()
        inp = f"seq {e.input_size}" if e.kind == "language" else f"{e.input_size}² x {e.in_channels}"
        params = sum(p.numel() for p in model.parameters())
        pv = "–" if e.paper_nodes is None else str(e.paper_nodes)
        print(
            f"| {name} | {e.paper_batch} | {inp} | {pv} | {compute_nodes(model)} | {params:,} | "
            + (f"{vanilla_peak_gib(e, model):.2f} | " if peak else "")
            + f"{e.description} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
