"""Reading checkpoints from disk (local Hugging Face directories of safetensors)."""
from cpumoe.loader.checkpoint import Checkpoint, CheckpointError

__all__ = ["Checkpoint", "CheckpointError"]
