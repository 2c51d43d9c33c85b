"""Post-training objectives on the training engine: reward models, DPO and GRPO."""

from megatron_lite.rl.dpo import DPOModule
from megatron_lite.rl.dpo_loss import dpo_terms
from megatron_lite.rl.grpo import GRPOModule
from megatron_lite.rl.grpo_config import GRPOConfig
from megatron_lite.rl.losses import bradley_terry_loss, preference_correct
from megatron_lite.rl.reward_model import RewardModelModule

__all__ = [
    "DPOModule",
    "GRPOConfig",
    "GRPOModule",
    "RewardModelModule",
    "dpo_terms",
    "bradley_terry_loss",
    "preference_correct",
]
