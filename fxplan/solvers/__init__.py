"""Stage 3, the solvers: lower sets, Kusumoto et al.'s DPs, Chen et al.'s plans, on a CostGraph.

Nothing here imports torch: a CostGraph in, a Plan out."""
