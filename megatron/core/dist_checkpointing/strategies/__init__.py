"""Storage backends for dist_checkpointing: ``torch_dist`` (PyTorch DCP) for shards, ``torch`` for the common state."""
