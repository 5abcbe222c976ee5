"""Stage 5, in-place application: a Plan applied to the model's own modules (``fxplan.auto_checkpoint``).

Checkpointed regions around the model's submodules, with a decision for each op inside them
(``torch.utils.checkpoint`` with selective-checkpoint policies), so that the model keeps its class, names,
``state_dict`` keys, hooks and ``forward`` signature, and torch.compile, FSDP2 and Hugging Face see what they
already know.
"""
