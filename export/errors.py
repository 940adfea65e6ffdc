"""Errors raised while reading a checkpoint (config.json, safetensors files)."""


class CheckpointError(ValueError):
    """A checkpoint is unusable; the message is one line naming the file, tensor or key."""
