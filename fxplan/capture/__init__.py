"""Stage 1, capture: a model and example inputs -> the torch.fx graph of one training step's forward,
the guards on what the graph cannot keep, fake copies, and the graph's recomputing forms
(units of recomputed inputs, recomputed regions)."""
