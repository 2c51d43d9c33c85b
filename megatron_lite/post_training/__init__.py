"""Post-training: quantization (nvidia-modelopt), distillation, speculative decoding and pruning of
megatron-lite models, on the training engine (see DESIGN.md §2 "Inference, post-training, RL")."""

from megatron_lite.post_training.export import save_quantized_hf
from megatron_lite.post_training.quantization import (  # modelopt itself is imported only when they run
    available_configs,
    perplexity,
    quantization_recipe,
    quantize,
    restore_quantization,
)

__all__ = ["available_configs", "perplexity", "quantization_recipe", "quantize", "restore_quantization", "save_quantized_hf"]
