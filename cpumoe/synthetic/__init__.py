"""Synthetic checkpoints: the files, tensor names and shapes of real Hugging Face MoE checkpoints, with seeded
random weights and a locally trained tokenizer (no downloads)."""
from cpumoe.synthetic.checkpoint import MODELS, make_checkpoint, tiny_overrides
from cpumoe.synthetic.tokenizer import make_tokenizer

__all__ = ["MODELS", "make_checkpoint", "make_tokenizer", "tiny_overrides"]
