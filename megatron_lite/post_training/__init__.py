"""Post-training: quantization (nvidia-modelopt), distillation, speculative decoding and pruning of
megatron-lite models, on the training engine (see DESIGN.md §2 "Inference, post-training, RL")."""
from megatron_lite.post_training.speculative import (
    DraftHeadConfig,
    DraftHeadExtension,
    load_draft_head,
    save_draft_head,
    speculative_generate,
)

__all__ = ["DraftHeadConfig", "DraftHeadExtension", "load_draft_head", "save_draft_head", "speculative_generate"]
