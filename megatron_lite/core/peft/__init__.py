"""Parameter-efficient fine-tuning: LoRA adapters on a built model (plain PyTorch; the callback is
``megatron_lite.callbacks.LoRA``)."""

from megatron_lite.core.peft.config import ALL_LINEAR, LINEAR_MODULES, MLA_LINEAR_MODULES, TARGET_NAMES, LoRAConfig
from megatron_lite.core.peft.expert_lora import ExpertLoRAAdapter
from megatron_lite.core.peft.lora import (
    LORA_RECIPE,
    LoRAAdapter,
    adapters,
    adapters_disabled,
    apply_lora,
    carry_adapters,
    has_adapters,
    is_adapter_parameter,
    lora_recipe,
    merge_lora,
    restore_lora,
)

__all__ = [
    "LORA_RECIPE",
    "carry_adapters",
    "lora_recipe",
    "restore_lora",
    "ALL_LINEAR",
    "LINEAR_MODULES",
    "MLA_LINEAR_MODULES",
    "TARGET_NAMES",
    "LoRAAdapter",
    "ExpertLoRAAdapter",
    "LoRAConfig",
    "adapters",
    "adapters_disabled",
    "apply_lora",
    "has_adapters",
    "is_adapter_parameter",
    "merge_lora",
]
