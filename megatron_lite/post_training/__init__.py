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
from megatron_lite.post_training.speculative import (
    DraftHeadConfig,
    DraftHeadExtension,
    load_draft_head,
    save_draft_head,
    speculative_generate,
)

__all__ = [
    "DraftHeadConfig",
    "DraftHeadExtension",
    "available_configs",
    "load_draft_head",
    "perplexity",
    "quantization_recipe",
    "quantize",
    "restore_quantization",
    "save_draft_head",
    "save_quantized_hf",
    "speculative_generate",
]
