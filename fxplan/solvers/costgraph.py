"""The cost graph: the planner's view of a network (Kusumoto et al., section 2).

A :class:`CostGraph` is a ``networkx.DiGraph`` whose nodes are the *compute* nodes of a traced model
(inputs and parameters excluded, as in the paper). Edge ``(v, w)`` means ``v`` is directly required to
compute ``w``. Node keys are the names of the torch.fx nodes they came from.

Node attributes:

``T``      forward cost of the node: predicted microseconds (``fxplan.costs.timecost``, the default), FLOPs with a
           floor, or the paper's 10-for-conv-1-otherwise rule; ``graph["T_seconds"]`` says which
``M``      bytes of the node's output (all tensors it returns)
``saved``  bytes autograd saves for the node's backward, beyond tensors counted elsewhere
``kind``   short op kind: ``"conv"``, ``"linear"``, ``"bn"``, ``"relu"``, ``"add"``, ``"cat"``, ...
``target`` a readable name of what the node runs (module path or function name)

Edges that carry no data but keep program order (random ops, readers after an in-place write) have
the attribute ``order_only=True``.

Graph attributes (``cg.graph[...]``): ``param_bytes``, ``input_bytes``, ``name``, ``gm``.

The planner knows nothing of torch: it only reads ``T``, ``M`` and the edges, so it can be tested on
graphs built with :meth:`CostGraph.from_edges`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import networkx as nx


class CostGraph(nx.DiGraph):
    """A DAG of compute nodes with time and memory costs; see the module docstring."""

    @classmethod
    def from_edges(
        cls,
        nodes: Iterable[str],
        edges: Iterable[tuple[str, str]],
        T: Mapping[str, float],
        M: Mapping[str, int],
    ) -> CostGraph:
        """Build a cost graph from plain data (for tests and synthetic examples)."""
        cg = cls()
        for v in nodes:
            cg.add_node(v, T=float(T[v]), M=int(M[v]), saved=0, kind="op", target=str(v))
        cg.add_edges_from(edges)
        if not nx.is_directed_acyclic_graph(cg):
            raise ValueError("a cost graph must be acyclic")
        return cg

    def subgraph_on(self, nodes: Iterable[str]) -> CostGraph:
        """A new cost graph of ``nodes`` (in the order given, node attributes copied) and the edges among
        them: what a segment's own plan is solved on (Chen et al.'s recursion, nested plans). Graph and
        edge attributes are not copied, so an order-only edge counts as a data edge there (its memory
        model sees one reader more than there is)."""
        nodes = list(nodes)
        sub = CostGraph()
        for v in nodes:
            sub.add_node(v, **self.nodes[v])
        keep = set(nodes)
        sub.add_edges_from((u, w) for u, w in self.edges(nodes) if w in keep)
        return sub

    def topo_order(self) -> list[str]:
        """Nodes in a topological order; the order of insertion (program order) where it is one."""
        order = list(self.nodes)
        position = {v: i for i, v in enumerate(order)}
        if all(position[v] < position[w] for v, w in self.edges):
            return order
        return list(nx.lexicographical_topological_sort(self, key=position.__getitem__))

    def delta_plus(self, S: Iterable[str]) -> set[str]:
        """δ⁺(S): nodes with an edge from some node of S."""
        return {w for v in S for w in self.successors(v)}

    def delta_minus(self, S: Iterable[str]) -> set[str]:
        """δ⁻(S): nodes with an edge into some node of S."""
        return {v for w in S for v in self.predecessors(w)}

    def is_lower_set(self, L: Iterable[str]) -> bool:
        """True if no edge enters L from outside it (δ⁻(L) ⊆ L)."""
        L = set(L)
        return self.delta_minus(L) <= L

    def boundary(self, L: Iterable[str]) -> set[str]:
        """∂(L) = δ⁻(V \\ L) ∩ L: the members of L that something outside L still needs."""
        L = set(L)
        return self.delta_minus(set(self.nodes) - L) & L

    def total_T(self, S: Iterable[str] | None = None) -> float:
        """T(S), the summed forward cost (all nodes when S is None)."""
        S = self.nodes if S is None else S
        return float(sum(self.nodes[v]["T"] for v in S))

    def total_M(self, S: Iterable[str] | None = None) -> int:
        """M(S), the summed output bytes (all nodes when S is None)."""
        S = self.nodes if S is None else S
        return int(sum(self.nodes[v]["M"] for v in S))
