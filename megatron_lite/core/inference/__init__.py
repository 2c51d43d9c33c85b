"""Text generation with the core GPT model."""
from megatron_lite.core.inference.generate import greedy_generate

__all__ = ["greedy_generate"]
