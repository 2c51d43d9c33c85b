"""Post-training objectives on the training engine: reward models (and next DPO, GRPO)."""
from megatron_lite.rl.losses import bradley_terry_loss, preference_correct
from megatron_lite.rl.reward_model import RewardModelModule

__all__ = ["RewardModelModule", "bradley_terry_loss", "preference_correct"]
