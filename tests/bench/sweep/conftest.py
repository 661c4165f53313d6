"""Shared pieces of the sweep tests: a tiny skeleton and the CLI arguments of a tiny layer sweep."""
import pytest

TINY_LAYER = ["bench", "sweep", "layer", "--skeleton", "qwen3-30b-a3b", "--skeleton-shape", "64,32,4,2",
              "--hidden", "64", "--inter", "32,64", "--num-experts", "4,8", "--top-k", "1,2", "--tokens", "1,4",
              "--threads", "1"]


@pytest.fixture
def tiny_layer_args():
    return list(TINY_LAYER)
