"""The GPT model family (Llama-style by default) built from tensor-parallel layers."""

from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.gpt import GPTModel

__all__ = ["GPTConfig", "GPTModel"]
