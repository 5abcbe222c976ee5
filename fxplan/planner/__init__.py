"""Stage 5, the planner: the measured budget search that turns a budget into one Plan
(candidates from the solvers, replayed on the cost graph, measured on fake tensors)."""
