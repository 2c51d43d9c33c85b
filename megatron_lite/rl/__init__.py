"""Post-training objectives on the training engine: reward models, DPO (and next GRPO)."""
from megatron_lite.rl.dpo import DPOModule
from megatron_lite.rl.dpo_loss import dpo_terms
from megatron_lite.rl.losses import bradley_terry_loss, preference_correct
from megatron_lite.rl.reward_model import RewardModelModule

__all__ = ["DPOModule", "RewardModelModule", "dpo_terms", "bradley_terry_loss", "preference_correct"]
