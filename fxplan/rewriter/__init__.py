"""Stage 4, the rewriter: a Plan -> a torch.fx GraphModule that recomputes what the plan drops."""
