"""Print the models_zoo table (docs/zoo.md): paper settings, torch.fx compute-node counts, parameter counts.

Usage: ``python scripts/zoo_table.py [NAME ...]`` (all networks by default). Compute nodes are the nodes of
``torch.fx.symbolic_trace(model)`` whose op is call_module, call_function or call_method (placeholders,
get_attr and output excluded), each model built in train mode.
"""

from __future__ import annotations

import sys

import torch
import torch.fx

import models_zoo

COMPUTE_OPS = ("call_module", "call_function", "call_method")


def compute_nodes(model: torch.nn.Module) -> int:
    """Number of compute nodes of the model's torch.fx graph."""
    return sum(n.op in COMPUTE_OPS for n in torch.fx.symbolic_trace(model).graph.nodes)


def main(argv: list[str]) -> None:
    rows = argv or models_zoo.names()
    print(f"torch {torch.__version__}, command: python scripts/zoo_table.py {' '.join(argv)}".rstrip())
    print()
    print("| network | paper batch | input | paper #V | fxplan FX nodes | parameters | description |")
    print("| --- | ---: | --- | ---: | ---: | ---: | --- |")
    for name in rows:
        e = models_zoo.get(name)
        model = e.build()
        inp = f"seq {e.input_size}" if e.kind == "language" else f"{e.input_size}² x {e.in_channels}"
        params = sum(p.numel() for p in model.parameters())
        pv = "–" if e.paper_nodes is None else str(e.paper_nodes)
        print(
            f"| {name} | {e.paper_batch} | {inp} | {pv} | {compute_nodes(model)} | {params:,} | "
            f"{e.description} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
