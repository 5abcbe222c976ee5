"""Stage 2, costs: the captured graph -> a CostGraph (bytes, saved values, time of every node)."""
