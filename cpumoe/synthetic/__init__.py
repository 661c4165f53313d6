"""Synthetic checkpoints: the files, tensor names and shapes of real Hugging Face MoE checkpoints, with seeded
random weights and a locally trained tokenizer (no downloads)."""
from cpumoe.synthetic.checkpoint import make_checkpoint, preset_names, tiny_overrides
from cpumoe.synthetic.tokenizer import make_tokenizer

__all__ = ["make_checkpoint", "make_tokenizer", "preset_names", "tiny_overrides"]
