"""Reading checkpoints from disk (local Hugging Face directories of safetensors)."""
from cpumoe.loader.checkpoint import Checkpoint, CheckpointConfig, CheckpointError

__all__ = ["Checkpoint", "CheckpointConfig", "CheckpointError"]
