"""Stage 2, one directory: validated headers in, a frozen ``CheckpointLayout`` out.

Which files belong to the checkpoint, how each tensor's pieces tile it, every problem named;
a mapping renames and fuses its tensors for a model.  No torch.
"""
